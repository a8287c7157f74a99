"""The `report` section of the run config: what the main job writes into the run directory
beside its metrics, summary and plots (`producers.report`, `producers.samples`)."""

from pydantic import Field

from schemas.section import Section


class ReportConfig(Section):
    samples_every: int = Field(8, ge=0)
    """Write every k-th group (prompt index % k == 0) to `samples.jsonl` in the run directory
    (and, with `trainer.wandb_project`, to a `samples` table):
    prompt, responses, rewards, failures, versions, staleness, step (`python -m ops.samples
    --out DIR` prints them). 0: none, and the main job does not read the rewards stream."""

    def samples(self, prompt_id: str) -> bool:
        """Whether the group of `prompt_id` (`<run>/<epoch>/<index>`) is one to write."""
        index = prompt_id.rsplit("/", 1)[-1]
        return self.samples_every > 0 and index.isdigit() and int(index) % self.samples_every == 0
