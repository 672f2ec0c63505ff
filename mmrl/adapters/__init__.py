"""Policy states on one model: trainable "default", frozen "old", and the reference "ref".

RL fine-tuning needs up to three versions of the policy: the one being trained ("default"), a frozen
copy for importance ratios or as an EMA target ("old"), and the starting point for KL penalties
("ref"). Keeping three models in memory costs 3x the weights; with LoRA the three states can share
the base weights and differ only in small adapters:

- "default": a trainable peft LoRA adapter. Its parameters are the only ones that require grad.
- "old":     a second, frozen adapter with the same config (only when ``old=True``), initialised
             equal to "default" and updated only by :meth:`PolicyStates.copy` / :meth:`PolicyStates.ema`.
- "ref":     all adapters disabled, i.e. exactly the base model (bitwise). When training starts from
             an existing LoRA (``ref_adapter_path``) "ref" is instead a frozen adapter loaded from that
             path, and "default"/"old" start equal to it.

Mechanism: ``peft.inject_adapter_in_model`` + the ``BaseTunerLayer`` switches, which work on any
``nn.Module`` (diffusers transformers, transformers VLMs, plain torch). Switching through peft's
``set_adapter`` silently flips ``requires_grad`` (the activated adapter becomes trainable), so
:meth:`PolicyStates.use` snapshots every parameter's ``requires_grad`` on entry, restores it right
after switching and again on exit (also on exceptions). Inside and outside ``use`` bodies only
"default"'s LoRA parameters require grad.

Full fine-tuning (``lora_config=None``): the trainable parameters are the model's parameters that
require grad when ``PolicyStates`` is built (normally all of them). There is nothing to switch cheaply,
so "old" and "ref" exist only when asked for, as parameter snapshots:

- ``old=True`` keeps one copy of the trainable parameters (+100% of their memory, on
  ``snapshot_device``; a CPU snapshot saves accelerator memory but every switch then copies).
- ``keep_ref_copy=True`` keeps a copy of the initial trainable parameters as "ref" (+100% again).
- Without them ``use("old")`` / ``use("ref")`` raise a ValueError saying how to enable them.
  Switching swaps ``param.data`` pointers (no copy when the snapshot lives on the parameter's device).

Files (``save(dir)``): one directory per adapter, ``dir/<name>/adapter_model.safetensors`` +
``adapter_config.json`` in peft's own format (keys ``base_model.model.<module>.lora_A.weight``, as
``PeftModel.save_pretrained`` writes them), loadable with ``PeftModel.from_pretrained(base, dir/<name>)``
or ``set_peft_model_state_dict``. For diffusers models the same weights are also written as
``dir/<name>/pytorch_lora_weights.safetensors`` in diffusers' pipeline format (keys prefixed
``transformer.``, or ``unet.`` for UNets; LoRA config in the safetensors metadata), so
``pipe.load_lora_weights(dir/<name>)`` works; diffusers picks that file by name, peft picks
``adapter_model.safetensors``. A "ref" that is the base model is not written. Full fine-tuning writes
``dir/<name>/model.safetensors`` (parameter names as in ``model.named_parameters()``) per state, or, for sharded
checkpoints (``save(dir, sharded_dir=...)``), only ``policy_states.json`` pointing at the torch.distributed.checkpoint
directory where every rank wrote its shards (``load`` reads them back on any number of ranks;
``load_sharded_state(dir, name)`` gives one state's whole tensors in one process).

FSDP2 (``DistContext.wrap_model(model, "fsdp")`` / ``fully_shard``) replaces every parameter by a DTensor
shard: call :meth:`PolicyStates.refresh` right after wrapping (and build the optimizer after it). Then
``copy``/``ema`` run on the local shards (all states are sharded identically; asserted), ``save`` and
``state_dict`` gather full tensors (collectives: every rank calls them; only rank 0 writes files, the files are
the same as one process writes) and ``load``/``load_state_dict`` take full tensors and keep each rank's slice.
Full fine-tuning under FSDP2: ``refresh`` re-lays the "old"/"ref" snapshots (built before wrapping, full on every
rank) out like their parameters (each rank keeps its slice, so the snapshots shrink to 1/world), and a state switch
copies values into the parameter shards instead of swapping pointers (FSDP all-gathers from its own shard storage).
Every in-place change of a sharded state first reshards the FSDP units (FSDP2 keeps the root unit's parameters
unsharded after a no-grad forward; without this the next forward would not see the change).

Cost (benchmarks/adapter_states.py, d=256 CPU models, r=8): "old" + a "ref" adapter add 2-3% of the
base parameter memory (deep copies: 200%); a ``use`` switch costs ~0.5-1.5 ms (it walks every LoRA
layer through peft's public switches), ``copy("default", "old")`` ~0.1 ms.

Usage::

    states = PolicyStates(transformer, LoraConfig(r=32, lora_alpha=64, target_modules=[...]), old=True)
    opt = torch.optim.AdamW(states.trainable_parameters(), lr=1e-4)
    with torch.no_grad(), states.use("ref"):
        ref_out = transformer(**batch)             # base model, bitwise
    loss = f(transformer(**batch), ref_out)          # "default" is active outside `use`
    loss.backward(); opt.step()                      # never step inside use("old"/"ref")
    states.ema("default", "old", decay=0.99)

Modules: ``states.py`` (the class: construction, ``use``, copy / EMA), ``lora.py`` and ``full.py`` (the two
modes), ``files.py`` (state dicts, ``save`` / ``load``), ``sharding.py`` (FSDP2 DTensor helpers).
"""

from mmrl.adapters.files import (  # noqa: F401 - the file names are part of the interface
    DIFFUSERS_WEIGHTS_NAME,
    FULL_WEIGHTS_NAME,
    INDEX_NAME,
    PEFT_CONFIG_NAME,
    PEFT_WEIGHTS_NAME,
    SHARDED_KEY,
    load_sharded_state,
    sharded_weights_dir,
)
from mmrl.adapters.states import STATE_NAMES, PolicyStates

__all__ = ["PolicyStates", "STATE_NAMES", "load_sharded_state", "sharded_weights_dir"]
