"""The HTTP endpoints of `unweight serve`, one module per family: completions, chat, models (with
/health) and metrics. Each holds a FastAPI APIRouter that app.create_app includes; what they share
(the router, the tokenizer, the sizes, the API key) is the app's ServerState (state.py)."""
