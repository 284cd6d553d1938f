"""The body of OpenAI's /v1/completions."""

from __future__ import annotations

from pydantic import Field

from web.chat.protocol import SAMPLING_VLLM_REFUSED, _Sampling
from web.http.bodies import as_prompt_list
from web.http.errors import bad_request
from web.http.fields import declare_fields


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # base64 of torch.save files (--enable-prompt-embeds). `parse_body` replaces large ones with
    # memoryviews on the body after validation (assignment is not validated).
    prompt_embeds: str | list[str] | None = None
    prompt_token_ids: list[int] | list[list[int]] | None = None  # token in (with prompt "" or absent)
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False

    def prompts(self) -> list[str | list[int] | dict[str, str]]:
        """Every prompt of the request: embeddings payloads first, then `prompt`'s (as vLLM orders them)."""
        if self.prompt is None and self.prompt_embeds is None and self.prompt_token_ids is None:
            raise bad_request("either prompt, prompt_token_ids or prompt_embeds is required", "prompt")
        embeds = [self.prompt_embeds] if isinstance(self.prompt_embeds, str) else list(self.prompt_embeds or ())
        if embeds and self.echo:
            raise bad_request("echo is not supported with prompt_embeds (the prompt has no text)", "echo")
        return [{"prompt_embeds": e} for e in embeds] + self._token_or_text_prompts()

    def _token_or_text_prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if self.prompt_token_ids is not None:  # token in, token out: `prompt` absent or ""
            if p not in (None, ""):
                raise bad_request("give prompt or prompt_token_ids, not both", "prompt_token_ids")
            ids = self.prompt_token_ids
            if not ids:
                raise bad_request("prompt_token_ids must not be empty", "prompt_token_ids")
            return as_prompt_list(ids)
        if p is None or (p == "" and self.prompt_embeds is not None):
            return []  # the openai client cannot omit `prompt`; vLLM's documented form sends ""
        return as_prompt_list(p)


declare_fields(CompletionRequest, "completions", {
    **SAMPLING_VLLM_REFUSED,
    "suffix": "insertion (a suffix after the completion) is not supported",
    "add_special_tokens": "the prompt is tokenized with the tokenizer's special tokens",
})
