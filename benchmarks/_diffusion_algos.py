"""The rows of compare_diffusion_algos.py: each algorithm's shipped tiny config and the published settings applied
on top (sources: docs/faster-diffusion.md, "The rows and their settings")."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Algo:
    config: str                   # the shipped tiny config in configs/diffusion/
    overrides: list[str] = field(default_factory=list)  # the published settings the shipped config lacks
    claim: str = "-"              # the published speed claim, as its paper states it
    claim_x: str = "-"            # the same as a ratio to Flow-GRPO where the paper gives one
    eval_every: int = 1           # held-out evaluation grid (fast algorithms every step: no bound by the grid)
    label: str = ""


ALGOS: dict[str, Algo] = {
    # the shipped tiny config (lr, clip and KL tuned for this model: docs/faster-diffusion.md lists the published ones)
    "flow_grpo": Algo("flow_grpo_tiny.yaml", [], "baseline", "1", 5, "Flow-GRPO"),
    # Flow-GRPO-Fast (flow_grpo README and config/grpo.py *_fast): one ODE trajectory per prompt, the group branches
    # at a random step of the first half; SDE and training on a window of 2 steps
    "flow_grpo_fast": Algo("flow_grpo_tiny.yaml", ["rollout.window_size=2", "rollout.window_range=[0,4]",
                                                    "rollout.same_noise=true"],
                           "2 trained steps: Flow-GRPO's reward per epoch (PickScore), no time ratio", "-", 2,
                           "Flow-GRPO-Fast"),
    # coefficients-preserving sampling, "a typical setting is noise_level = 0.8" (flow_grpo README); no KL, as every
    # published CPS config (flow_grpo config/grpo.py *_fast_nocfg: beta 0): CPS's small step std makes the Gaussian KL
    # of the SDE rows far larger, so Flow-GRPO's 0.01 holds the policy at the start (measured, docs)
    "cps": Algo("flow_grpo_tiny.yaml", ["rollout.sde_type=cps", "rollout.noise_level=0.8", "algo.kl.coef=0"],
                "better GenEval and samples, no speed claim", "-", 5, "Flow-GRPO + CPS"),
    # MixGRPO's scripts: no KL, shared initial noise per group, the window moved every 25 (Flash: 20) of 300
    # iterations, i.e. every 9 (7) of Flow-GRPO's 105 steps here
    "mixgrpo": Algo("mixgrpo_tiny.yaml", ["algo.kl.coef=0", "rollout.same_noise=true", "rollout.window_move_every=9"],
                    "~50% less time per iteration than DanceGRPO", "~2 per step (vs DanceGRPO)", 2, "MixGRPO"),
    "mixgrpo_flash": Algo("mixgrpo_flash_tiny.yaml", ["algo.kl.coef=0", "rollout.same_noise=true",
                                                      "rollout.window_move_every=7"],
                          "71% less time per iteration than DanceGRPO", "~3.4 per step (vs DanceGRPO)", 1,
                          "MixGRPO-Flash"),
    "dgpo": Algo("dgpo_tiny.yaml", [], "~20x faster than Flow-GRPO (~30x on GenEval)", "~20", 1, "DGPO"),
    # DGPO's config/dgpo_wocfg_emaref.py (its jpeg-compressibility setting): the group weights against the EMA "old"
    # policy instead of the fixed start, beta 2000, clip 1e-5, no KL, rollouts from the EMA after 200 updates
    "dgpo_emaref": Algo("dgpo_tiny.yaml", ["algo.ref=old", "algo.beta=2000", "algo.clip_range=1e-5",
                                           "algo.kl.coef=0", "algo.old_rollout_after=200"],
                        "as DGPO", "~20", 1, "DGPO, EMA reference"),
    # DiffusionNFT's config: timestep_fraction 0.99, KL 1e-4 to the reference
    "nft": Algo("nft_tiny.yaml", ["algo.timestep_fraction=0.99", "algo.kl.coef=1e-4"],
                "up to 25x more efficient than Flow-GRPO", "up to 25", 1, "DiffusionNFT"),
    # AWM's dgx_awm.py: on-policy rollouts, min(0.001 n, 0.3) EMA, global std, KL 0.001, first step skipped
    "awm": Algo("awm_tiny.yaml", ["algo.rollout_state=default", "algo.ema_schedule=awm_linear",
                                  "reward.std_mode=global", "algo.kl.coef=0.001", "algo.skip_first_step=true"],
                "up to 24x (arXiv v1) / 34x (ICML) over Flow-GRPO", "24-34", 1, "AWM"),
    # flow_grpo's config/dpo.py and train_sd3_dpo.py: best vs worst of each group, logit-normal noise levels
    "dpo_online": Algo("dpo_tiny_online.yaml", ["algo.pairing=best_worst", "algo.max_pairs_per_step=0",
                                                "algo.timestep_sampling=logit_normal", "algo.sigma_shift=0"],
                       "no speed claim (a baseline)", "-", 2, "online Diffusion-DPO"),
    "flow_grpo_lowres": Algo("flow_grpo_tiny.yaml", ["rollout.height=32", "rollout.width=32"], "-", "-", 3,
                             "Flow-GRPO at 32x32"),
}

# the other algorithms' order in the queue: the likely longest first, so two workers end together
QUEUE_ORDER = ["cps", "flow_grpo_lowres", "flow_grpo_fast", "dpo_online", "mixgrpo", "dgpo", "dgpo_emaref", "nft",
               "awm", "mixgrpo_flash"]
