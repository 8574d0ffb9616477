"""The OpenAI-compatible server on a build (`specpilot serve`): wire format, engine scheduler, app."""
