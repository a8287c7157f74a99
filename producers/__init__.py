"""The main job: `python -m producers.prompts`: datasets in, PromptEvents out behind the
admission gate, the local fleet it launches, the stall watch and the run's report."""
