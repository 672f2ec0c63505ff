"""PolicyStates in LoRA mode: peft adapters "default" / "old" (/ "ref" from a saved LoRA) injected into one model.

A mixin of :class:`mmrl.adapters.PolicyStates`; see the ``mmrl.adapters`` docstring for the mechanism.
"""

from __future__ import annotations

import copy as _copy
import warnings
from pathlib import Path

from torch import nn

from mmrl.adapters.files import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME


class _LoraStates:
    """LoRA-mode construction of PolicyStates: inject, check and collect the adapters."""

    def _init_lora(self, lora_config, ref_adapter_path, autocast_adapter_dtype: bool) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.functional import cast_adapter_dtype
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) for m in self.model.modules()):
            raise ValueError(
                "PolicyStates: the model already contains peft adapter layers; pass the plain base model "
                "and give an existing LoRA as ref_adapter_path"
            )
        ref_config = None
        if ref_adapter_path is not None:
            ref_dir = Path(ref_adapter_path)
            for fname in (PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME):
                if not (ref_dir / fname).is_file():
                    raise FileNotFoundError(
                        f"PolicyStates: ref_adapter_path {str(ref_dir)!r} must hold {PEFT_CONFIG_NAME} and "
                        f"{PEFT_WEIGHTS_NAME} (peft format); {fname} not found"
                    )
            ref_config = LoraConfig.from_pretrained(str(ref_dir))
            if lora_config is None:
                lora_config = ref_config
            else:
                self._check_same_shape_config(lora_config, ref_config, ref_dir)
        if not isinstance(lora_config, LoraConfig):
            raise TypeError(
                f"PolicyStates: lora_config must be a peft.LoraConfig or None, got {type(lora_config).__name__}"
            )
        for cfg in (lora_config, ref_config):
            if cfg is None:
                continue
            if cfg.bias != "none":
                raise ValueError(
                    f"PolicyStates: LoraConfig.bias must be 'none' (got {cfg.bias!r}): trained base biases "
                    "would be shared by default/old/ref"
                )
            if cfg.modules_to_save or getattr(cfg, "trainable_token_indices", None):
                raise ValueError(
                    "PolicyStates: LoraConfig.modules_to_save / trainable_token_indices are not supported "
                    "(they train full base modules, not adapter states)"
                )

        self._configs: dict[str, object] = {}
        names = ["default"] + (["old"] if self.has_old else []) + (["ref"] if ref_config is not None else [])
        with warnings.catch_warnings():
            # peft warns on every injection after the first ("multiple adapters"): that is the point here.
            warnings.filterwarnings("ignore", message=".*peft_config.*")
            for name in names:
                cfg = _copy.deepcopy(ref_config if name == "ref" else lora_config)
                inject_adapter_in_model(cfg, self.model, adapter_name=name)
                cast_adapter_dtype(self.model, name, autocast_adapter_dtype=autocast_adapter_dtype)
                self._configs[name] = self.model.peft_config[name]
        self._layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        if not self._layers:
            raise ValueError(
                f"PolicyStates: LoraConfig.target_modules={lora_config.target_modules!r} matched no module of "
                f"{type(self.model).__name__}"
            )
        self._adapters = names
        self._ref_is_base = ref_config is None
        names_by_id = {id(p): n for n, p in self.model.named_parameters()}
        self._params: dict[str, dict[str, nn.Parameter]] = {}
        self._param_names: dict[str, list[str]] = {}
        for name in names:
            params = self._collect_adapter_params(name)
            self._params[name] = params
            self._param_names[name] = [names_by_id[id(p)] for p in params.values()]
        for name in names[1:]:
            self._check_same_keys("default", name)

        # Only default's LoRA weights train; base weights (frozen by peft already) and other adapters do not.
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in self._params["default"].values():
            p.requires_grad_(True)
        self._switch("default")

        if ref_config is not None:
            self._load_adapter_file("ref", Path(ref_adapter_path))
            self.copy("ref", "default")
        if self.has_old:
            self.copy("default", "old")

    @staticmethod
    def _check_same_shape_config(cfg, ref_cfg, ref_dir: Path) -> None:
        def norm(c):
            tm = c.target_modules
            tm = sorted(tm) if isinstance(tm, (list, set, tuple)) else tm
            return {"r": c.r, "lora_alpha": c.lora_alpha, "target_modules": tm, "use_rslora": c.use_rslora,
                    "use_dora": c.use_dora, "rank_pattern": dict(c.rank_pattern or {}),
                    "alpha_pattern": dict(c.alpha_pattern or {})}
        a, b = norm(cfg), norm(ref_cfg)
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        if diff:
            details = ", ".join(f"{k}: given {x!r}, file {y!r}" for k, (x, y) in diff.items())
            raise ValueError(
                f"PolicyStates: lora_config does not match {str(ref_dir / PEFT_CONFIG_NAME)!r} ({details}); "
                "pass lora_config=None to use the saved config"
            )

    def _collect_adapter_params(self, adapter: str) -> dict[str, nn.Parameter]:
        """Adapter tensors keyed like peft's saved keys (adapter name removed): ``<module>.lora_A.weight``."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        out: dict[str, nn.Parameter] = {}
        for mod_name, mod in self.model.named_modules():
            if not isinstance(mod, BaseTunerLayer):
                continue
            for layer_name in mod.adapter_layer_names:
                container = getattr(mod, layer_name, None)
                if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)) or adapter not in container:
                    continue
                prefix = f"{mod_name}.{layer_name}" if mod_name else layer_name
                item = container[adapter]
                if isinstance(item, nn.Parameter):
                    out[prefix] = item
                else:
                    for pn, p in item.named_parameters():
                        out[f"{prefix}.{pn}"] = p
        return out

    def _check_same_keys(self, a: str, b: str) -> None:
        pa, pb = self._params[a], self._params[b]
        if list(pa) != list(pb) or any(pa[k].shape != pb[k].shape for k in pa):
            raise ValueError(f"PolicyStates: adapters {a!r} and {b!r} do not have the same tensors/shapes")
