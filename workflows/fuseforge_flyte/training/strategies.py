"""How the model is replicated or sharded over ranks: DDP, FSDP2 or DeepSpeed ZeRO.

Each strategy wraps the model, owns the optimizer and LR schedule, runs one
micro-batch forward/backward, applies the optimizer step, saves/loads its own
training state (checkpoint/manager.py says which format each strategy writes), and gathers
the full fp32 weights under their plain transformers names for export (export.py).

Precision: on GPU, DDP holds bf16 weights with fp32 master copies (precision.py; fp16 keeps fp32 weights
under autocast with a gradient scaler); FSDP2 keeps fp32
shards and computes in bf16 through MixedPrecisionPolicy (fp32 gradient reduction);
DeepSpeed holds bf16/fp16 weights with fp32 master copies in the optimizer. On the
CPU everything is fp32.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional

import torch

from fuseforge_flyte.training import lora, optim, precision
from fuseforge_flyte.training.checkpoint.dcp_metadata import RestrictedReader, deepspeed_load
from fuseforge_flyte.training.distributed import DistContext
from fuseforge_flyte.training.lm_head import install_lm_head_guard
from fuseforge_flyte.training.precision import TORCH_DTYPES, MasterWeights, master_dtype_for
from fuseforge_flyte.training.models import decoder_layers
from fuseforge_flyte.training.spec import TrainSpec

STRATEGIES = ("ddp", "fsdp", "deepspeed")


def _weights_only_load(path: str, device: torch.device):
    return torch.load(path, map_location=device, weights_only=True)


# Name components that wrappers (activation checkpointing, torch.compile, FSDP1) insert; never transformers names.
# (DDP's and DeepSpeed's "module." never appears: state dicts are taken from the unwrapped model.)
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def plain_key(name: str) -> str:
    """A state-dict key without wrapper components, i.e. the name transformers gives the tensor."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU tensor (no copy when it already is one)."""
    return tensor.detach().to("cpu")


def _persistent_buffers(model: torch.nn.Module):
    """(name, buffer) of the buffers that belong in a state dict (the non-persistent ones do not)."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


class Strategy:
    """Common interface; subclasses fill in wrapping, stepping and state I/O."""

    name = ""
    needs_process_group = False

    def __init__(self, spec: TrainSpec, ctx: DistContext, fused_loss: bool):
        self.spec = spec
        self.ctx = ctx
        self.fused_loss = fused_loss  # fuseforge's fused loss computes from lm_head.weight directly
        self.dtype = precision.compute_dtype(spec, ctx.device)
        # LoRA: frozen weights are rebuilt from the model source on resume; state holds the trained ones only
        self.trained_only = lora.lora_on(spec)
        self.model: torch.nn.Module  # what forward is called on
        self.inner: torch.nn.Module  # the Hugging Face model inside the wrapper

    def setup(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def forward(self, batch: Dict[str, torch.Tensor], last_micro: bool) -> torch.Tensor:
        """The loss of one micro-batch: the model called on `batch` (input_ids, labels, position_ids, ...)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's share of the step's global mean loss (the engine divided by the global
        loss-token count); each strategy undoes its wrapper's own averaging over ranks/micro-batches."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def discard_step(self) -> None:
        """Drop the gradients of a step that will not be applied (non-finite loss)."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def save(self, directory: str) -> None:
        raise NotImplementedError

    def load(self, directory: str) -> None:
        raise NotImplementedError

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's weights under the plain transformers names, on the CPU, on rank 0 (None elsewhere).

        Collective: every rank must call it (sharded strategies gather). On a CPU run the
        tensors may share memory with the live model: read them, do not modify them.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the wrapper holds beyond the process group (called before the group goes)."""


class _TorchOptimized(Strategy):
    """Shared by DDP and FSDP: a torch AdamW + LambdaLR driven by the engine."""

    def _trained_parameters(self):
        """(name, parameter) pairs the optimizer updates."""
        return self.model.named_parameters()

    def _build_optimizer(self, masters: Optional[MasterWeights] = None) -> None:
        groups = optim.param_groups(self._trained_parameters(), self.spec.weight_decay)
        if masters is not None:
            self.optimizer = optim.master_adamw(groups, self.spec.lr, masters)
        else:
            self.optimizer = optim.adamw(groups, self.spec.lr)
        self.scheduler = optim.scheduler(self.optimizer, self.spec.warmup_steps, self.spec.steps)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.ctx.world_size).backward()  # DDP and FSDP average gradients over ranks

    def _clip(self) -> None:
        if self.spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self._trained_parameters()], self.spec.grad_clip)

    def _gradients(self) -> List[torch.Tensor]:
        return [p.grad for _, p in self._trained_parameters() if p.grad is not None]

    def _clip_in_fused_step(self) -> bool:
        """Clip inside a fused AdamW (torch's, or MasterAdamW): it divides each gradient by the optimizer's
        `grad_scale` tensor as it reads it, so clipping costs one read of the gradients (the norm) instead of a
        read and a rewrite."""
        if self.spec.grad_clip <= 0 or not optim.divides_by_grad_scale(self.optimizer):
            return False
        # in fp32 whatever the gradients' dtype (a bf16 norm would be off by up to 0.4%), in one multi-tensor
        # launch (torch's foreach norm; clip_grad_norm_'s would return bf16 norms for bf16 gradients)
        gradients = self._gradients()
        norms = torch._foreach_norm(gradients, 2, dtype=torch.float32) if gradients else []
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its inverse is the same
        self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.spec.grad_clip, min=1.0).to(torch.float32)
        return True

    def optimizer_step(self) -> None:
        clipped_in_step = self._clip_in_fused_step()
        if not clipped_in_step:
            self._clip()
        self.optimizer.step()
        if clipped_in_step:
            del self.optimizer.grad_scale
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


class DDPStrategy(_TorchOptimized):
    """DistributedDataParallel; a single process trains the plain model."""

    name = "ddp"

    def setup(self, model: torch.nn.Module) -> None:
        self.inner = model
        low = master_dtype_for(self.dtype, self.ctx.device)
        self.masters = MasterWeights(model, low, self.ctx.world_size) if low is not None else None
        if self.masters is not None:
            self.model = model  # no DDP wrapper: MasterWeights all-reduces the fp32 gradients itself
        elif self.ctx.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=ids)
        else:
            self.model = model
        self._build_optimizer(self.masters)
        self.scaler = torch.amp.GradScaler("cuda") if self.dtype == "fp16" else None

    def _autocast(self):
        if self.dtype == "fp32" or self.masters is not None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=TORCH_DTYPES[self.dtype])

    def _trained_parameters(self):
        return self.masters.named_parameters() if self.masters is not None else super()._trained_parameters()

    def _gradients(self) -> List[torch.Tensor]:
        return self.masters.gradients() if self.masters is not None else super()._gradients()

    def forward(self, batch: Dict[str, torch.Tensor], last_micro: bool) -> torch.Tensor:
        if self.masters is not None:
            self.masters.start_micro_batch(last_micro)
        elif self.model is not self.inner:  # DDP: all-reduce gradients only on the last micro-batch
            self.model.require_backward_grad_sync = last_micro
        with self._autocast():
            return self.model(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        if self.masters is not None:  # the masters' all-reduce sums this rank's share of the global mean
            return loss.backward()
        loss = loss * self.ctx.world_size  # DDP averages gradients over ranks
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(self) -> None:
        if self.masters is not None:  # MasterAdamW writes the bf16 model as it updates the masters
            self.masters.finish_gradients()
            super().optimizer_step()
            self.masters.clear_gradients()
            return
        if self.scaler is None:
            return super().optimizer_step()
        self.scaler.unscale_(self.optimizer)
        self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_step(self) -> None:
        if self.masters is not None:
            self.masters.finish_gradients()
            self.masters.clear_gradients()
        super().discard_step()

    def _model_state(self) -> Dict[str, torch.Tensor]:
        """The model's weights in fp32: the masters where the model holds bf16 copies (LoRA: the trained ones)."""
        state = self.masters.state_dict(self.inner) if self.masters is not None else self.inner.state_dict()
        return lora.trained_keys(self.inner, state) if self.trained_only else state

    def save(self, directory: str) -> None:
        if self.ctx.is_main:
            torch.save(self._model_state(), os.path.join(directory, "model.pt"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
            torch.save(self.scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))
            if self.scaler is not None:
                torch.save(self.scaler.state_dict(), os.path.join(directory, "scaler.pt"))

    def load(self, directory: str) -> None:
        device = self.ctx.device
        state = _weights_only_load(os.path.join(directory, "model.pt"), device)
        if self.trained_only:  # the frozen base is as built; the masters (if any) cover the trained parameters
            lora.load_trained(self.inner, state, "checkpoint")
            if self.masters is not None:
                self.masters.load_state_dict(self.inner, state, strict=False)
        elif self.masters is not None:
            self.masters.load_state_dict(self.inner, state)
        else:
            self.inner.load_state_dict(state)
        self.optimizer.load_state_dict(_weights_only_load(os.path.join(directory, "optimizer.pt"), device))
        self.scheduler.load_state_dict(_weights_only_load(os.path.join(directory, "scheduler.pt"), "cpu"))
        if self.scaler is not None:
            self.scaler.load_state_dict(_weights_only_load(os.path.join(directory, "scaler.pt"), "cpu"))

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """Every rank holds the whole fp32 model: rank 0 returns its own weights, no communication."""
        if not self.ctx.is_main:
            return None
        return {plain_key(k): _cpu(v) for k, v in self._model_state().items()}


def _fsdp_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4/2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


class FSDPStrategy(_TorchOptimized):
    """FSDP2: each decoder layer is its own unit, the root unit holds embeddings, final norm and lm_head.

    Keeping lm_head in the root unit means its weight is gathered for the whole root
    forward, so a fused loss computed inside the causal LM's forward sees it whole.
    """

    name = "fsdp"
    needs_process_group = True

    def setup(self, model: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard, MixedPrecisionPolicy = _fsdp_api()
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        kwargs: Dict = {"mesh": mesh}
        if self.dtype != "fp32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[self.dtype], reduce_dtype=torch.float32)
        for layer in decoder_layers(model, "strategy='fsdp'"):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = self.inner = model
        self._build_optimizer()

    def forward(self, batch: Dict[str, torch.Tensor], last_micro: bool) -> torch.Tensor:
        self.model.set_requires_gradient_sync(last_micro)
        return self.model(**batch).loss

    def save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, "dcp"))
        if self.ctx.is_main:
            torch.save(self.scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))

    def load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, storage_reader=RestrictedReader(os.path.join(directory, "dcp")))  # no code in .metadata
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self._state_options())
        self.scheduler.load_state_dict(_weights_only_load(os.path.join(directory, "scheduler.pt"), "cpu"))

    def _state_options(self, **kwargs):
        """torch's state-dict options; LoRA: frozen parameters left out (and not expected back on load)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self.trained_only:
            kwargs.update(ignore_frozen_params=True, strict=False)
        return StateDictOptions(**kwargs)

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The fp32 shards all-gathered one tensor at a time and moved to rank 0's CPU (the others get nothing).

        torch's get_model_state_dict already drops FSDP/checkpoint-wrapper name parts;
        plain_key is applied again so that every strategy's keys come out the same way.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=self._state_options(full_state_dict=True, cpu_offload=True))
        if not self.ctx.is_main:
            return None
        return {plain_key(k): _cpu(v) for k, v in state.items()}


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as err:  # an ImportError: permanent, a restart cannot install it (permanent.py)
        raise ImportError(
            "strategy='deepspeed' needs DeepSpeed, an optional extra: pip install 'fuseforge[deepspeed]' "
            "(DS_BUILD_OPS=0 skips compiling its CUDA ops at install time)"
        ) from err
    return deepspeed


def deepspeed_config(spec: TrainSpec, world_size: int, device: torch.device) -> Dict:
    """The DeepSpeed config generated from the spec (no config file to keep in sync)."""
    dtype = precision.compute_dtype(spec, device)
    zero: Dict = {"stage": spec.zero_stage, "contiguous_gradients": True, "overlap_comm": device.type == "cuda"}
    if spec.offload:
        pin = device.type == "cuda"
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if spec.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config: Dict = {
        "train_micro_batch_size_per_gpu": spec.batch_size,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.batch_size * spec.grad_accum * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        # our torch AdamW is also used with CPU offload (DeepSpeedCPUAdam is chosen on GPU)
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if spec.grad_clip > 0:
        config["gradient_clipping"] = spec.grad_clip
    return config


class DeepSpeedStrategy(Strategy):
    """DeepSpeed ZeRO stage 1-3 through deepspeed.initialize, config from `deepspeed_config`.

    ZeRO-3 with the fused loss: lm_head's own hooks gather its weight for the
    forward, but the fused loss produces the weight gradient during the forward and
    lm_head's output (a placeholder) is not on the loss's autograd path, so ZeRO's
    backward hook for lm_head never re-gathers the weight before that gradient
    lands ("size of tensor a (0) must match" in backward). Registering the weight as
    an external parameter of the causal LM keeps it gathered for the root module's
    forward and backward.
    """

    name = "deepspeed"
    needs_process_group = True

    def setup(self, model: torch.nn.Module) -> None:
        deepspeed = import_deepspeed()
        spec = self.spec
        # DeepSpeed asserts LOCAL_RANK is set; set it only for this run (close() removes what was added),
        # so that a later in-process user (accelerate, another run) does not take the process for a worker.
        self._added_local_rank = "LOCAL_RANK" not in os.environ
        os.environ.setdefault("LOCAL_RANK", str(self.ctx.local_rank))
        if spec.zero_stage == 3 and self.fused_loss:
            deepspeed.zero.register_external_parameter(model, model.get_output_embeddings().weight)
        use_cpu_adam = spec.offload and self.ctx.device.type == "cuda"

        def make_optimizer(groups):
            if use_cpu_adam:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(groups, lr=spec.lr, betas=optim.BETAS, eps=optim.EPS, adamw_mode=True)
            return optim.adamw(groups, spec.lr)

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=optim.param_groups(model.named_parameters(), spec.weight_decay),
            optimizer=make_optimizer,
            lr_scheduler=lambda opt: optim.scheduler(opt, spec.warmup_steps, spec.steps),
            config=deepspeed_config(spec, self.ctx.world_size, self.ctx.device),
            dist_init_required=False,
        )
        self.model = self.engine
        self.inner = self.engine.module

    def forward(self, batch: Dict[str, torch.Tensor], last_micro: bool) -> torch.Tensor:
        return self.engine(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by gradient_accumulation_steps and averages over ranks, then steps only at
        # the boundary: undo both, the loss share is already normalised by the global token count
        self.engine.backward(loss * (self.ctx.world_size * self.spec.grad_accum))
        self.engine.step()

    def optimizer_step(self) -> None:
        """Nothing: engine.step() after the last micro-batch's backward applied the update."""

    def discard_step(self) -> None:
        """Nothing: the skip policy runs no backward at all under DeepSpeed (grad_accum is 1)."""

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(os.path.join(directory, "deepspeed"), tag="state", save_latest=False)

    def load(self, directory: str) -> None:
        """DeepSpeed's files are read through torch.load(weights_only=True) and a small allow-list
        (dcp_metadata.deepspeed_load), not its engine's weights_only=False: loading them runs no code."""
        checkpoint_engine = self.engine.checkpoint_engine
        checkpoint_engine.load = deepspeed_load  # this instance only, for this load
        try:
            path, _ = self.engine.load_checkpoint(
                os.path.join(directory, "deepspeed"), tag="state",
                load_optimizer_states=True, load_lr_scheduler_states=True,
            )
        finally:
            del checkpoint_engine.load
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}/deepspeed")

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The fp32 master weights from the ZeRO optimizer, assembled whole on rank 0's CPU.

        The module's own weights are bf16/fp16 copies on GPU runs; the optimizer's fp32
        partitions are what training updates, so those are exported (ZeRO-3's
        16-bit consolidated state dict would round them). A parameter without a master
        copy (frozen) is taken from the module, gathered under ZeRO-3, and upcast to
        fp32. One parameter at a time, in the same order on every rank: each gather is a
        collective and peak extra memory is one full parameter per rank.
        """
        from deepspeed.utils import safe_get_full_fp32_param

        zero3 = self.spec.zero_stage == 3
        main = self.ctx.is_main
        state: Dict[str, torch.Tensor] = {}
        gathered: Dict[int, torch.Tensor] = {}  # id(param) -> tensor: a tied parameter is gathered once
        for name, param in self.inner.named_parameters(remove_duplicate=False):
            if id(param) not in gathered:
                full = safe_get_full_fp32_param(param) if param.requires_grad else None
                if full is None:
                    full = self._module_param(param, zero3)
                shape = tuple(getattr(param, "ds_shape", param.shape))
                if tuple(full.shape) != shape:
                    raise RuntimeError(f"DeepSpeed gave {name} shaped {tuple(full.shape)}, expected {shape}")
                # only rank 0 keeps anything; a copy, as DeepSpeed may reuse its gather buffers
                gathered[id(param)] = full.detach().to("cpu", torch.float32, copy=True) if main else None
                del full
            if main:
                state[plain_key(name)] = gathered[id(param)]
        if not main:
            return None
        for name, buf in _persistent_buffers(self.inner):  # never partitioned by ZeRO
            state[plain_key(name)] = buf.detach().to("cpu", copy=True)
        return state

    @staticmethod
    def _module_param(param: torch.nn.Parameter, zero3: bool) -> torch.Tensor:
        """The module's copy of `param`, whole (gathered for ZeRO-3), upcast to fp32."""
        if not zero3 or not hasattr(param, "ds_id"):
            return param.detach().float()
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().float().clone()

    def close(self) -> None:
        """Drop the engine's hooks and DeepSpeed's cached process groups (stale once the group is destroyed)."""
        import deepspeed.comm
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

        self.engine.destroy()
        # ZeRO-3 swaps torch.nn.functional.linear for its own process-wide ("persists unless manually
        # reset"): put torch's back, or every later linear in this process runs through DeepSpeed's.
        original_linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
        if original_linear is not None:
            torch.nn.functional.linear = original_linear
        if self.ctx.owns_group:
            deepspeed.comm.destroy_process_group()
            self.ctx.owns_group = False
        if self._added_local_rank:
            os.environ.pop("LOCAL_RANK", None)


_BY_NAME = {cls.name: cls for cls in (DDPStrategy, FSDPStrategy, DeepSpeedStrategy)}


def strategy_class(name: str):
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"TrainSpec.strategy: unknown strategy {name!r}; choose one of {list(STRATEGIES)}") from None


def make_strategy(spec: TrainSpec, ctx: DistContext, model: torch.nn.Module,
                  fused_loss: Optional[bool] = None) -> Strategy:
    """Wrap `model` per spec.strategy.

    With a fused loss (default: spec.kernels) the lm_head weight is made available to
    the root forward (ZeRO-3) and guarded against being read partitioned.
    """
    fused = spec.kernels if fused_loss is None else fused_loss
    strategy = strategy_class(spec.strategy)(spec, ctx, fused)
    strategy.setup(model)
    if fused:
        install_lm_head_guard(strategy.inner)
    return strategy
