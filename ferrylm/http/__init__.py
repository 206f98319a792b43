"""HTTP pieces shared by `ferrylm serve` (server/) and `ferrylm gateway` (router/): body limits,
disconnect handling, drain, request-id middleware, the OpenAI error type, the pydantic protocol,
prompt rendering, and the draining uvicorn server. Nothing here imports server/, router/ or gateway/."""
