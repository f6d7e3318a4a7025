"""OpenAI's Responses API (what Codex speaks), as one translation layer over the chat pipeline.

protocol.py (request bodies) → translate.py (a chat request; custom_tools.py shows freeform
tools as one-string functions) → server/openai/chat.py's ChatRun (the same templates, tool parsing,
reasoning split, constrained decoding and engine as chat completions) → items.py / run.py
(output items, the Response object and its SSE events); routes.py has the two routes.
"""
