"""The OpenAI-compatible server: `api` (Starlette routes over an engine backend), `worker_backend` (the
headless engine, no Qt), `inapp` (the app's own engine client, and the server thread), `cli` (`moedesk serve`),
and `remote` (the app chatting with another OpenAI-compatible server)."""
