"""Anthropic's Messages API (what Claude Code speaks), as one translation layer over the chat pipeline.

protocol.py (request bodies) → translate.py (a chat request; billing.py keeps Claude Code's
per-request nonce out of the prompt) → server/openai/chat.py's ChatRun (the same templates, tool
parsing, constrained decoding and engine as chat completions) → blocks.py / run.py (content
blocks, the message object and its SSE events) with errors.py's error shape; routes.py has the
two routes, paths.py the paths whose auth and size errors take Anthropic's shape.
"""
