"""serve.py's parts: the HTTP app (OpenAI API, Server-Sent Events), the API key, and the chat page (web/)."""
