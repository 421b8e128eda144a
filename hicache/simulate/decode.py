"""The decode steps one engine runs between prefills, in virtual time (the trace player's,
for `SimulationConfig.engine_requests` with a calibrated profile). Torch-free."""

from __future__ import annotations


class DecodeSteps:
    """The decode steps an engine runs between prefills (`engine_requests` with a profile).

    After its first token a request decodes `output_length - 1` more steps, one row each,
    batched with whatever else decodes. A prefill that arrives meanwhile is admitted when
    the step running ends (the engine's scheduler runs between steps), and its own step
    carries the decode rows on (they lose no time but that step's length).
    """

    def __init__(self) -> None:
        self.start_s = 0.0  # steps run from here, `step_s` each, until `until_s`
        self.until_s = 0.0
        self.step_s = 0.0

    def wait_s(self, at_s: float) -> float:
        """How long a prefill ready at `at_s` waits for the step running then."""
        if at_s >= self.until_s or self.step_s <= 0:
            return 0.0
        into = (at_s - self.start_s) % self.step_s
        return self.step_s - into if into > 0 else 0.0

    def prefilled(self, began_s: float, end_s: float, num_steps: int, step_s: float) -> None:
        """A prefill ran [began_s, end_s) and its request decodes `num_steps` steps."""
        left_s = max(0.0, self.until_s - began_s - self.step_s)  # one step rode along
        self.step_s = max(step_s, self.step_s if left_s > 0 else 0.0)
        self.start_s = end_s
        self.until_s = end_s + max(left_s, num_steps * self.step_s)
