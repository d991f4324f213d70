"""One chat and its rendering, shared by the .venv test of the ingress's render_chat and the vLLM-tier
test of the tiny model's chat template (so both sides agree on the same text). No imports."""

CHAT_MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
CHAT_TEXT = "<|system|>\nbe brief\n<|user|>\nhello there\n<|assistant|>\n"
