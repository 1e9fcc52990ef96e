from dataclasses import dataclass

from .registry import register
from .snapkv import SnapKV


@register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., 2024): SnapKV's score with per-layer budgets shaped like a pyramid,
    since lower layers spread attention widely and upper layers concentrate it. Layer l of L gets

        B_l = B_max - (B_max - B_min) * l / (L - 1),   B_min = B / beta,  B_max = 2B - B_min

    so the average stays B and the total memory equals that of a uniform budget B.
    """

    beta: int = 20
    name = "pyramidkv"

    def layer_budgets(self, budget: int, num_layers: int, caps: list[int] | None = None) -> list[int]:
        """The pyramid above; ``caps`` are a recorded policy's (``Policy.prompt_tokens``), never
        given to PyramidKV, whose schedule is fixed before any prompt."""
        if num_layers == 1:
            return [budget]
        lo = max(1, budget // self.beta)
        hi = 2 * budget - lo
        out = [round(hi - (hi - lo) * i / (num_layers - 1)) for i in range(num_layers)]
        out[0] += budget * num_layers - sum(out)  # rounding: keep the total exact
        return out
