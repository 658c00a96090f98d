"""quantize(model, recipe, ...): the library's main entry point.

It quantizes the model IN PLACE: every targeted nn.Linear is replaced by a QuantLinear
(the replaced Linear is emptied onto the meta device), and the model is moved to the
compute dtype (ptq.devices: the model's 16-bit dtype on CUDA and on CPUs with fast bf16
matmuls, float32 on other CPUs). It returns the same model, with `model.ptq_report`
describing what was done. Nothing here prints (progress bars aside).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ptq import cpu_attention, moe
from ptq.algorithms import compiled
from ptq.algorithms.cholesky import describe as describe_factorisation
from ptq.algorithms.compiled import unavailable as compiled_unavailable
from ptq.algorithms.gptq_compiled import unavailable as gptq_loop_unavailable
from ptq.algorithms.rtn import rtn
from ptq.arch import check_linear_layers, check_mappings, find_blocks
from ptq.calibration.data import calibration_batches
from ptq.calibration.resume import BlockStore, restore_blocks
from ptq.calibration.observers import AbsMaxObserver, HessianObserver, Observers
from ptq.calibration.runner import BlockRun, BlockWeights, Inputs, batch_size_for, run_blocks
from ptq.calibration.sequential import Stages, execution_stages, quantize_block_sequentially
from ptq.coverage import coverage
from ptq.devices import compute_dtype_for, cpu_budget, cpu_parallel, cpu_settings, torch_ops_on_one_thread
from ptq.distributed import rank, sample_share, share_from, world_size
from ptq.errors import PtqError
from ptq.kv import calibrate_kv, check_kv_model, use_kv_cache
from ptq.models import float32_names
from ptq.modules import QuantLinear
from ptq.openmp import LONG_SPIN_NOTE, spins_long
from ptq.moe_policy import check_experts_scheme, natural_key, router_notes, router_safe
from ptq.targets import matches
from ptq.recipe import AWQStep, GPTQStep, Recipe, WeightStep, load_recipe
from ptq.report import QuantizationReport
from ptq.smoothing import smooth_block_
from ptq.stage_solve import install as install_solved
from ptq.stage_solve import gather_rows, replace_linear, rows_split, solve_shared_input


def select_linears(model: nn.Module, step: WeightStep) -> dict[str, nn.Linear]:
    """The nn.Linear modules the step targets and does not ignore, checked against its scheme.
    MoE routers (ptq.moe.router_names) are never chosen: they stay in 16 bits."""
    check_linear_layers(model, step.targets, step.ignore)  # GPT-2's Conv1D: refused
    routers = set(moe.router_names(model))
    chosen = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name not in routers
        and matches(name, module, step.targets)
        and not matches(name, module, step.ignore)
    }
    if not chosen:
        raise PtqError(f"no Linear matches targets {step.targets} (minus ignore {step.ignore})")
    group = step.scheme.weights.group_size
    for name, module in chosen.items():
        if group and module.in_features % group:
            raise PtqError(
                f"group_size {group} does not divide in_features {module.in_features} of layer "
                f"'{name}'; choose a divisor of it, or add '{name}' to ignore"
            )
    return chosen


@torch.no_grad()
def check_finite(model: nn.Module) -> None:
    """Raise PtqError naming the model's first weight that holds a NaN or an Inf. The CPU's
    weights are checked side by side, one thread each (cpu_parallel): torch's min-max over
    one weight on two threads took longer than on one (a SmolLM2-shaped model, 135M bf16
    weights on a 2-core Xeon: 89 ms on two threads, 63 on one, 35 split over both)."""
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point() and p.numel()]

    def finite(param: Tensor) -> bool:  # min and max show NaN and Inf, with no temporary as large as the weight
        return bool(torch.isfinite(torch.stack(param.aminmax())).all())

    on_cpu = [p for _, p in params if p.device.type == "cpu"]
    found = iter(cpu_parallel([functools.partial(finite, p) for p in on_cpu], cpu_budget()))
    for name, param in params:
        if not (next(found) if param.device.type == "cpu" else finite(param)):
            raise PtqError(f"model weight '{name}' contains NaN or Inf; the source model is broken")


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def quantize(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    tokenizer=None,
    data=None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    show_progress: bool = True,
    store: BlockStore | None = None,
    weights: BlockWeights | None = None,
) -> nn.Module:
    """Quantize `model` in place with `recipe` (a Recipe, a YAML path or a preset name).

    data: calibration data for steps that need it (GPTQ): None for the recipe's own
    calibration source (the bundled text by default), a list of strings, a
    datasets.Dataset, or token-id tensors. tokenizer is needed unless data is token ids.
    dtype: the compute dtype; by default ptq.devices.compute_dtype_for(device, model dtype).
    store: keeps each finished block on disk and restores the blocks an earlier,
    interrupted run with the same recipe, data and dtypes finished (ptq.calibration.resume).
    MoE experts fused by transformers are first split into one Linear per expert and
    projection (ptq.moe; the model computes the same), also when a later check fails.
    Several processes (torchrun, accelerate launch; a torch.distributed process group
    already initialised): every rank passes the same model, recipe and data; each runs its
    share of the calibration samples, the statistics are combined, each stage is solved by
    one rank, and every rank ends with the same quantized model (save it on rank 0 only).
    weights: the model is on the meta device and its weights are streamed from disk, one
    block at a time, and written out as each is finished (ptq.streaming.quantize_streamed,
    which builds this argument; it checks each weight for NaN and Inf as it loads it).
    On a CPU where torch was imported before ptq (openmp.spins_long), torch's ops run on one
    thread at a time in the calibration passes, where ptq's own threads do the parallel work;
    the report says so.
    """
    recipe = load_recipe(recipe)
    step, kv = recipe.weight_step, recipe.kv_cache
    start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if weights is None:
        check_finite(model)
    if kv is not None:
        check_kv_model(model, kv)
    linears, planned = {}, None
    if step is not None:
        moe.unfuse_experts_(model)
        linears = select_linears(model, step)
        for transform in recipe.transforms:
            check_mappings(model, transform.mappings, transform.step_name)
        check_experts_scheme(model, linears, step)
        planned = coverage(model, {f"{name}.weight" for name in linears}, step.ignore)
    batch_size = None
    if uses_calibration_data(recipe):  # before touching the model: bad data must leave it as it was
        cal = recipe.calibration
        batches = calibration_batches(
            tokenizer, cal.dataset if data is None else data,
            samples=cal.samples, seq_len=cal.seq_len, seed=cal.seed, text_column=cal.text_column,
            messages_column=cal.messages_column,
            split=cal.split, config_name=cal.config_name, vocab_size=model.get_input_embeddings().num_embeddings,
        )
        batch_size = batch_size_for(*batches.shape, device)  # of all the samples, in every process
        batches = _own_share(batches, batch_size, model, store, weights)
    checkpoint_dtype = _model_dtype(model)
    report = QuantizationReport(recipe, checkpoint_dtype, dtype or compute_dtype_for(device, checkpoint_dtype),
                                device.type, coverage=planned)
    if data is not None and uses_calibration_data(recipe):
        report.calibration_data = _describe_data(data)
    # torch's ops on one thread in the calibration passes (devices.torch_ops_on_one_thread)
    long_spin = device.type == "cpu" and spins_long() and step is not None and weights_use_calibration(recipe)
    if device.type == "cpu":
        report.cpu = cpu_settings()
        if long_spin:  # a note, not a setting: the bits are the same either way
            report.notes.append(LONG_SPIN_NOTE)
        if weights_use_calibration(recipe):
            if report.compute_dtype == torch.bfloat16:
                # Hessians and AWQ's Gram matrices of bf16 inputs (observers.HessianObserver)
                kernel = compiled.gram_kernel()
                report.cpu["bf16_hessians"] = f"{kernel} (compiled)" if kernel else "oneDNN GEMMs"
            # the calibration passes' causal attention (ptq/cpu_attention.py)
            compiled_attention = cpu_attention.applies(model, device, report.compute_dtype)
            report.cpu["calibration_attention"] = "compiled" if compiled_attention else "the model's own"
        if isinstance(step, GPTQStep) and step.scheme.weights.type == "int":
            why = gptq_loop_unavailable()
            report.cpu["gptq_loop"] = "torch" if why else "compiled"
            # the Hessians' Cholesky factor and its inverse (ptq/algorithms/cholesky.py)
            report.cpu["gptq_factorisation"] = describe_factorisation()
            if why:
                report.notes.append(f"GPTQ's column loop ran in torch, several times slower than compiled: {why}")
        if any(isinstance(t, AWQStep) for t in recipe.transforms):
            why = compiled_unavailable()
            report.cpu["awq_grid"] = "torch" if why else "compiled"
            if why:
                report.notes.append(f"AWQ's candidate weights were computed in torch, several times slower than "
                                    f"compiled: {why}")
    if planned is not None:
        report.notes.extend(planned.notes())
    else:
        report.notes.append("weights left as they are: the recipe quantizes the KV cache only")
    report.notes.extend(router_notes(model))
    cast_parameters_(model, report.compute_dtype)
    model.eval()
    if step is not None and weights_use_calibration(recipe):
        with torch_ops_on_one_thread() if long_spin else contextlib.nullcontext():
            _quantize_with_calibration(model, linears, recipe, batches, batch_size, device, report, show_progress,
                                       store, weights)
    elif step is not None and weights is not None:
        _quantize_rtn_streamed(model, linears, step, report, weights, find_blocks(model)[0])
    elif step is not None:
        _quantize_rtn(model, linears, step, report)
    if kv is not None:
        kv_start = time.perf_counter()
        state = calibrate_kv(model, batches if kv.static else None, kv, device=device, batch_size=batch_size,
                             scale_dtype=checkpoint_dtype, show_progress=show_progress)
        report.add_time("KV cache calibration", time.perf_counter() - kv_start)
        use_kv_cache(model, state)
        report.notes.append(_kv_note(kv, recipe))
    report.seconds = time.perf_counter() - start
    model.ptq_report = report
    return model


def check_samples_for(processes: int, samples: int, batch: int) -> None:
    """Every process needs at least one batch (of `batch` samples: runner.batch_size_for's)."""
    if samples < processes * batch:
        raise PtqError(f"{samples} calibration samples are too few for {processes} processes: each needs a "
                       f"batch of {batch}; set calibration.samples to {processes * batch} or more")


def _own_share(batches: torch.Tensor, batch_size: int, model: nn.Module, store, weights) -> torch.Tensor:
    """With several processes (ptq.distributed): this rank's slice of the calibration
    samples, in whole batches of batch_size (batch_size_for's, of all the samples); what
    multi-process calibration cannot do yet is refused."""
    size = world_size()
    if size == 1:
        return batches
    check_samples_for(size, batches.shape[0], batch_size)
    if any(moe.has_experts(block) for block in find_blocks(model)[1]):
        raise PtqError("multi-process calibration does not combine the statistics of routed experts yet; "
                       "quantize MoE models in one process")
    if store is not None or weights is not None:
        raise PtqError("multi-process calibration neither keeps blocks for --resume nor streams weights yet; "
                       "run one process for those")
    share = sample_share(batches.shape[0], batch_size)
    return batches[share.start:share.stop]


def _describe_data(data) -> str:
    """ptq.quantize's data= in a few words (the checkpoint's model card names the source)."""
    if isinstance(data, torch.Tensor):
        return f"token ids {list(data.shape)} given to ptq.quantize"
    count = f" of {len(data):,} items" if hasattr(data, "__len__") else ""
    return f"a {type(data).__name__}{count} given to ptq.quantize"


def _kv_note(kv, recipe: Recipe) -> str:
    if kv.static:
        cal = recipe.calibration
        return (f"KV cache: {kv.describe()}, scales from keys after rotary embedding and values of "
                f"{cal.samples} x {cal.seq_len} calibration tokens, every layer")
    return f"KV cache: {kv.describe()}; quantized as tokens arrive (no calibration)"


@torch.no_grad()
def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters; buffers (rotary frequencies: float32) stay as they are,
    as from_pretrained(dtype=...) leaves them, and so do the parameters the model's class
    keeps in float32 (ptq.models.float32_names)."""
    keep = float32_names(model)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != dtype and not (name in keep and param.dtype == torch.float32):
            param.data = param.data.to(dtype)


def uses_calibration_data(recipe: Recipe) -> bool:
    """Whether the recipe runs calibration samples through the model (else: RTN, kivi alone)."""
    return weights_use_calibration(recipe) or (recipe.kv_cache is not None and recipe.kv_cache.static)


def weights_use_calibration(recipe: Recipe) -> bool:
    step = recipe.weight_step
    return step is not None and (needs_calibration(step) or bool(recipe.transforms))


def needs_calibration(step: WeightStep) -> bool:
    """GPTQ needs Hessians; static activation scales need the activations' range."""
    acts = step.scheme.input_activations
    return isinstance(step, GPTQStep) or (acts is not None and not acts.dynamic)


def _make_observer(step: WeightStep) -> Callable[[], Observers]:
    """What a stage's shared input is observed for: the Hessian (GPTQ), the range (static acts)."""
    wanted = {}
    if isinstance(step, GPTQStep):
        wanted["hessian"] = HessianObserver
    if needs_calibration(step) and step.scheme.input_activations is not None:
        wanted["absmax"] = AbsMaxObserver
    return lambda: Observers(**{name: make() for name, make in wanted.items()})


def _quantize_rtn(model: nn.Module, linears: dict[str, nn.Linear], step: WeightStep, report, how: str = "rtn") -> None:
    for name, linear in linears.items():
        qw = rtn(linear.weight.detach(), step.scheme.weights, report.checkpoint_dtype, step.observer)
        replace_linear(model, name, linear, qw, step)
        report.layers[name] = how


def _quantize_rtn_streamed(model: nn.Module, linears: dict[str, nn.Linear], step: WeightStep, report,
                           weights: BlockWeights, blocks_path: str, how: str = "rtn") -> None:
    """_quantize_rtn on a streamed model: the Linears of one block (or one Linear outside
    the blocks) at a time, loaded before and written out and freed after."""
    units: dict[str, dict[str, nn.Linear]] = {}
    for name, linear in linears.items():
        inside = name.startswith(blocks_path + ".")
        unit = ".".join(name.split(".")[: blocks_path.count(".") + 2]) if inside else name
        units.setdefault(unit, {})[name] = linear
    for unit, members in units.items():
        weights.load(unit)
        _quantize_rtn(model, members, step, report, how)
        weights.done(unit)


def _calibrate_groups(run: BlockRun, order: Stages, mine: dict, make_observer, solve_stage, install,
                      sequential: bool) -> list[str]:
    """Observe a group of stages in one pass over the batches, then quantize its stages;
    one group for the whole block, or (true-sequential) one per stage, each calibrated on
    the outputs of the groups quantized before it. In an MoE block the experts' stages
    join up (all gate/up, then all down: ptq.moe.sequential_groups). Returns the Linears
    of the stages no batch reached (experts the router never chose), left unquantized.

    solve_stage(stage, observer) solves a stage (on its owner rank, with several
    processes) and install(solved) shares and installs it: with several processes a
    group's stages are all solved first, each rank solving its own at the same time."""
    unreached: list[str] = []
    if not sequential:
        groups = [sum(order.stages, [])]
    else:
        groups = moe.sequential_groups(run.block, order.stages)
    for i, group in enumerate(groups):
        # a pass may stop before the next group, unless this one's Linears interleave with it (experts)
        interleaved = moe.expert_of(run.block, group[0]) is not None
        stop_at = mine[groups[i + 1][0]] if i + 1 < len(groups) and not interleaved else None
        observers = run.collect({n: mine[n] for n in group}, make_observer, stop_at=stop_at)
        members = set(group)
        solved = []
        for stage in order.stages:  # Linears of one stage share their observer
            if stage[0] not in members:
                continue
            if stage[0] in observers:
                solved.append(solve_stage(stage, observers[stage[0]]))
                if world_size() == 1:
                    install(solved.pop())
            else:
                unreached += stage
        for pending in solved:
            install(pending)
    return unreached


def _quantize_unrouted(model: nn.Module, run: BlockRun, linears: dict[str, nn.Linear], step: WeightStep,
                       report) -> None:
    """RTN for the Linears of experts no calibration token was routed to (GPTQ has no
    Hessian for them), named in the notes expert by expert."""
    _quantize_rtn(model, linears, step, report, how="rtn (fallback)")
    prefix = run.name + "."
    experts = {prefix + (moe.expert_of(run.block, name[len(prefix):]) or name[len(prefix):]) for name in linears}
    names = ", ".join(sorted(experts, key=natural_key))
    report.notes.append(f"RTN (fallback) for experts no calibration token was routed to: {names}")


def _quantize_with_calibration(
    model, linears, recipe: Recipe, batches, batch_size: int, device, report, show_progress,
    store: BlockStore | None = None,
    weights: BlockWeights | None = None,
) -> None:
    step, cal = recipe.weight_step, recipe.calibration
    blocks_path, _ = find_blocks(model)
    inside = {n: m for n, m in linears.items() if n.startswith(blocks_path + ".")}
    outside = {n: m for n, m in linears.items() if n not in inside}
    if outside and weights is not None:
        _quantize_rtn_streamed(model, outside, step, report, weights, blocks_path)
        report.notes.append(f"RTN for Linears outside the decoder blocks: {', '.join(outside)}")
    elif outside:  # no calibration inputs are captured outside the blocks (e.g. lm_head)
        _quantize_rtn(model, outside, step, report)
        report.notes.append(f"RTN for Linears outside the decoder blocks: {', '.join(outside)}")
    resumed = restore_blocks(model, blocks_path, batches, step, report, store) if store else {}

    orders: dict[tuple, Stages] = {}  # blocks of one class and Linears run in one order
    kept = float32_names(model)
    float32_ids = {id(p) for n, p in model.named_parameters() if n in kept and p.dtype == torch.float32}
    make_observer = _make_observer(step)
    solves = itertools.count()

    def process(run: BlockRun) -> Inputs | None:
        prefix = run.name + "."
        mine = {n[len(prefix):]: m for n, m in inside.items() if n.startswith(prefix)}
        key = (type(run.block), tuple(mine))
        if key not in orders:  # MoE: every expert called, so that the order fits every block
            with moe.all_experts(run.block, moe.has_experts(run.block)):
                orders[key] = execution_stages(run, mine)
        order = orders[key]
        if order.never_called:
            _quantize_rtn(model, {prefix + n: mine.pop(n) for n in order.never_called}, step, report)
            report.notes.append(f"RTN for Linears the forward pass never calls: {', '.join(order.never_called)}")
        called = None if moe.has_experts(run.block) else order.called_in_order(mine)  # where stats passes may stop
        for transform in recipe.transforms:
            transform = router_safe(run.block, transform, report)
            if transform is None:
                continue
            start = time.perf_counter()
            smoothed = smooth_block_(model, run, transform, step.scheme.weights, report.checkpoint_dtype, called)
            report.add_time(f"{transform.step_name} statistics", smoothed.statistics_seconds)
            report.add_time(f"{transform.step_name} search", time.perf_counter() - start - smoothed.statistics_seconds)
            report.smoothing.update({f"{run.name}: {pair}": what for pair, what in smoothed.done.items()})
            report.notes.extend(note for note in smoothed.skipped if note not in report.notes)
        if recipe.transforms:
            _round_to_(run.block, report.checkpoint_dtype, float32_ids)
        if not needs_calibration(step):
            _quantize_rtn(model, {prefix + n: m for n, m in mine.items()}, step, report)
            return None

        def solve_stage(stage: list[str], observer: Observers) -> tuple:
            linears = {prefix + rel: mine[rel] for rel in stage}
            stats = observer.value  # every rank reads it: the ranks' statistics combine
            if world_size() > 1 and rows_split(step):  # each rank solves a slice of the rows
                return linears, None, solve_shared_input(linears, stats, step, report, (rank(), world_size()))
            owner = next(solves) % world_size()  # else each stage is solved once, by one rank
            solved = solve_shared_input(linears, stats, step, report) if rank() == owner else None
            return linears, owner, solved

        def install(pending: tuple) -> dict[str, nn.Module]:
            linears, owner, solved = pending
            if owner is None:  # the row slices of every rank, joined
                rows = [linear.out_features for linear in linears.values()]
                solved = gather_rows([share_from(solved, r) for r in range(world_size())], rows)
            else:
                solved = share_from(solved, owner)
            modules = install_solved(model, linears, solved, step, report)
            return {name[len(prefix):]: module for name, module in modules.items()}

        def quantize_stage(stage: list[str], observer: Observers) -> dict[str, nn.Module]:
            return install(solve_stage(stage, observer))

        start = time.perf_counter()
        outputs, unreached = None, []
        # replaying recorded outputs needs every Linear called in every batch: routed experts are not
        with moe.all_experts(run.block, cal.moe_calibrate_all_experts):
            if cal.true_sequential and order.called_once and not moe.has_experts(run.block):
                outputs = quantize_block_sequentially(run, order, mine, make_observer, quantize_stage)
            else:
                unreached = _calibrate_groups(run, order, mine, make_observer, solve_stage, install,
                                              cal.true_sequential)
        if unreached:
            _quantize_unrouted(model, run, {prefix + rel: mine[rel] for rel in unreached}, step, report)
        report.add_time("calibration passes", time.perf_counter() - start)
        return outputs

    notes_seen = len(report.notes)

    def block_done(index: int, block: nn.Module, hidden: list[torch.Tensor]) -> None:
        """Keep the finished block, what the report learnt about it, and the next inputs."""
        nonlocal notes_seen
        prefix = f"{blocks_path}.{index}"
        record = {
            "layers": {n: how for n, how in report.layers.items() if n.startswith(prefix + ".")},
            "modules": {n: {"actorder": m.actorder, "observer": m.observer}
                        for n, m in block.named_modules() if isinstance(m, QuantLinear)},
            "notes": report.notes[notes_seen:],
            "smoothing": {k: v for k, v in report.smoothing.items() if k.startswith(prefix + ": ")},
        }
        notes_seen = len(report.notes)
        store.save_block(index, block, record, hidden)

    run_blocks(model, blocks_path, batches, process, device=device, batch_size=batch_size, propagate=cal.propagate,
               show_progress=show_progress, block_done=block_done if store else None, weights=weights,
               notes=report.notes, **resumed)


@torch.no_grad()
def _round_to_(module: nn.Module, dtype: torch.dtype, keep: set[int] = frozenset()) -> None:
    """Round rescaled parameters to the checkpoint dtype, so that the model in memory is
    the one the checkpoint stores (norms are saved in that dtype, not quantized); `keep`:
    ids of parameters stored in float32 (ptq.models.float32_names)."""
    for param in module.parameters():
        if param.is_floating_point() and id(param) not in keep:
            param.copy_(param.to(dtype))


