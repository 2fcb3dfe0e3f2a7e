def TokensPrompt(prompt_token_ids):  # noqa: N802  # vLLM's class name
    return prompt_token_ids
