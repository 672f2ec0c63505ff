"""The "old" policy of the decoupled diffusion recipes (DiffusionNFT, AWM): the EMA schedules of its decay and the
count of optimizer updates that drives them (resumable). After every update, `states.ema("default", "old", d)` with
d = ema_decay(schedule, updates so far)."""

from __future__ import annotations

# name -> (flat steps, rate per step, cap):  decay(n) = 0 if n < flat else min(rate * (n - flat), cap), n = updates
# source: NVlabs/DiffusionNFT scripts/train_nft_sd3.py return_decay (decay_type 0, 1, 2)
NFT_EMA_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),                 # decay_type 0: old <- new after every step
    "linear": (0, 0.001, 0.5),             # decay_type 1: min(0.001 n, 0.5)            (PickScore, GenEval)
    "delayed_linear": (75, 0.0075, 0.999),  # decay_type 2: 0 for n < 75, then min(0.0075 (n - 75), 0.999)  (OCR)
}
AWM_EMA_SCHEDULES: dict[str, tuple[int, float, float]] = {
    **NFT_EMA_SCHEDULES,
    "awm_linear": (0, 0.001, 0.3),  # source: train_sd3_awm.py kl_ema_decay_type 'linear', kl_ema_decay 0.3
}


def ema_decay(schedule: str, n: int, schedules: dict[str, tuple[int, float, float]] = AWM_EMA_SCHEDULES) -> float:
    """EMA decay of the "old" policy after `n` optimizer updates in total (the official `global_step`)."""
    if schedule not in schedules:
        raise ValueError(f"algo.ema_schedule: unknown schedule {schedule!r}; valid: {sorted(schedules)}")
    flat, rate, cap = schedules[schedule]
    return 0.0 if n < flat else min(rate * (n - flat), cap)


class UpdateCounter:
    """Resumable integer: optimizer updates so far (the EMA schedule position)."""

    def __init__(self):
        self.updates = 0

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
