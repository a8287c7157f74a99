"""The prompt producer: datasets in, PromptEvents out, behind the admission gate."""
