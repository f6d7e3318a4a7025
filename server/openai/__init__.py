"""The OpenAI wire protocol: Chat Completions, Completions, Models, and the chat pipeline the other protocols
translate onto."""
