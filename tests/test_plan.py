"""ptq plan: exact bytes (against ptq's own modules, caches and checkpoint files), the worked
examples practitioners quote, the recommendation rules, and the command line."""

import json
import math
import sys

import pytest
import torch

import ptq
from ptq.cli import main
from ptq.kv import KVCacheScheme, QuantizedKVCache
from ptq.modules import QuantLinear
from ptq.plan import (accelerator, candidate_from_recipe, estimate, evaluate_candidates, read_model, recommend,
                      workload)
from ptq.plan.arithmetic import Attention, kv_bytes, linear_bytes
from ptq.plan.estimate import GB, STANDARD
from ptq.recipe import parse_recipe
from ptq.safetensors_check import safetensors_header, weight_files
from ptq.schemes import PRESETS

KIB = 1024
# Workspace assumption of every number below (ptq plan's defaults): the engine takes 90% of
# each GPU's memory (vLLM's gpu_memory_utilization), 1 GB of it goes to activations and CUDA
# graphs, the weights take their share, the KV cache the rest. GB = 10^9 bytes.
UTILIZATION, WORKSPACE = 0.90, 1e9


def llama_config(hidden, layers, heads, kv_heads, intermediate, vocab, tied=False):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": 8192, "dtype": "bfloat16", "rms_norm_eps": 1e-5}


LLAMA3_8B = llama_config(4096, 32, 32, 8, 14336, 128256)
LLAMA3_70B = llama_config(8192, 80, 64, 8, 28672, 128256)
LLAMA2_7B = llama_config(4096, 32, 32, 32, 11008, 32000)  # multi-head attention: as many kv heads as heads


def config_folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def by_name(estimates):
    return {e.candidate.name: e for e in estimates}


def linear_shapes(hidden, layers, heads, kv_heads, intermediate, head_dim=128):
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    return per_layer * layers


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return read_model(str(config_folder(tmp_path_factory.mktemp("plan"), LLAMA3_8B)))


def test_worked_example_llama3_8b_on_one_h100_at_8k(llama8b):
    """BF16: 16 GB of weights, 128 KiB of KV per token, ~50 requests at 8K; FP8 (weights and
    cache): weights ~halve, KV 64 KiB per token, ~2.3x the concurrency."""
    assert llama8b.parameters == 8_030_261_248  # from the architecture (config.json alone)
    work = workload(context=8192)
    est = by_name(evaluate_candidates(llama8b, accelerator("H100"), work))
    bf16, fp8 = est["BF16"], est["FP8+KV-FP8"]

    assert bf16.weight_bytes == 2 * 8_030_261_248  # 16.06 GB
    assert bf16.kv_bytes_per_token == 128 * KIB == 2 * 32 * 8 * 128 * 2
    assert bf16.kv_bytes_per_request == 1 << 30  # 1 GiB per request at 8K
    usable = UTILIZATION * 80e9 - WORKSPACE - bf16.weight_bytes
    assert bf16.max_concurrency == math.floor(usable / (1 << 30)) == 51

    # FP8: every Linear but lm_head in one byte per weight + a bf16 scale per output channel;
    # embeddings, lm_head and norms in bf16; the fp8 cache's per-layer k/v scales (bf16)
    embed = lm_head = 128256 * 4096
    norms = (2 * 32 + 1) * 4096
    linears = linear_shapes(4096, 32, 32, 8, 14336)
    expected = sum(o * i + 2 * o for o, i in linears) + 2 * (embed + lm_head + norms) + 2 * 32 * 2
    assert fp8.weight_bytes == expected == 9_083_953_280
    assert fp8.kv_bytes_per_token == 64 * KIB
    usable = UTILIZATION * 80e9 - WORKSPACE - fp8.weight_bytes
    assert fp8.max_concurrency == math.floor(usable / (1 << 29)) == 115
    assert 2.0 < fp8.max_concurrency / bf16.max_concurrency < 2.6

    # W4A16 g128: int32 words of 8 weights, a bf16 scale per 128, weight_shape (2 x int64)
    w4 = est["W4A16"]
    assert w4.weight_bytes == sum(o * i // 2 + o * (i // 128) * 2 + 16 for o, i in linears) \
        + 2 * (embed + lm_head + norms)
    assert w4.linear_bits == pytest.approx(4.125)
    assert bf16.binds == fp8.binds == "bandwidth"  # a full GPU of cache is read at every step


def test_arithmetic_is_in_explain_and_json(tmp_path, capsys):
    folder = config_folder(tmp_path, LLAMA3_8B)
    assert main(["plan", str(folder), "--gpu", "H100-SXM", "--context", "8192", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "128.0 KiB" in out and "64.0 KiB" in out and "16.06 GB" in out
    assert "usable per GPU: 0.90 x 80 GB - 1 GB workspace" in out
    assert "2 (K,V) x 32 layers x 8 kv heads x 128 head_dim x 2 bytes = 131,072.0 bytes" in out
    assert main(["plan", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {c["name"]: c for c in data["candidates"]}
    assert rows["BF16"]["weight_bytes"] == 16_060_522_496 and rows["BF16"]["max_concurrency"] == 51
    assert data["model"]["parameters"] == 8_030_261_248 and data["workload"]["workspace_gb"] == 1.0


def test_llama3_70b_on_two_h200(tmp_path):
    facts = read_model(str(config_folder(tmp_path, LLAMA3_70B)))
    assert facts.parameters == 70_553_706_496
    work = workload(context=8192, gpus=2)
    est = by_name(evaluate_candidates(facts, accelerator("H200"), work))
    bf16 = est["BF16"]
    assert bf16.weight_bytes == 2 * 70_553_706_496
    assert bf16.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * KIB
    usable = UTILIZATION * 141e9 - WORKSPACE - bf16.weight_bytes / 2  # per GPU
    assert bf16.max_concurrency == math.floor(usable / (bf16.kv_bytes_per_request / 2)) == 41  # 4 kv heads each
    # one H200 cannot hold BF16 weights (141 GB > 0.9 x 141 GB): the plan says so and picks FP8
    one = workload(context=8192)
    alone = evaluate_candidates(facts, accelerator("H200"), one)
    assert by_name(alone)["BF16"].max_concurrency == 0 and by_name(alone)["BF16"].binds == "memory (does not fit)"
    chosen, why = recommend(alone, one)
    assert chosen.candidate.name == "FP8+KV-FP8" and "BF16: does not fit" in why[0]


def test_gqa_and_mha_caches(tmp_path):
    gqa = read_model(str(config_folder(tmp_path, LLAMA3_8B, "gqa")))
    mha = read_model(str(config_folder(tmp_path, LLAMA2_7B, "mha")))
    assert mha.parameters == 6_738_415_616  # Llama-2-7B
    work = workload(context=4096)
    g = by_name(evaluate_candidates(gqa, accelerator("A100-80GB"), work))["BF16"]
    m = by_name(evaluate_candidates(mha, accelerator("A100-80GB"), work))["BF16"]
    assert m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * KIB == 4 * g.kv_bytes_per_token


def test_fp8_has_no_kernel_on_a100_and_int8_takes_its_place(llama8b):
    work = workload(context=8192, concurrency=64)  # BF16 holds 51 requests on 80 GB
    estimates = evaluate_candidates(llama8b, accelerator("A100-80GB"), work)
    est = by_name(estimates)
    assert not est["FP8+KV-FP8"].kernel and "no fp8" in est["FP8+KV-FP8"].kernel_note
    assert est["BF16"].binds == "memory"
    chosen, why = recommend(estimates, work)
    # W8A8 int8 keeps a 16-bit cache: 57 requests < 64; W4A16 alone 60; with an fp8 cache: no fp8;
    # so KIVI int4 (ptq's kernel) is the first that holds 64
    assert est["W8A8-INT8"].max_concurrency == 57 and est["W4A16"].max_concurrency == 60
    assert chosen.candidate.name == "W4A16+KV-INT4"
    on_h100 = evaluate_candidates(llama8b, accelerator("H100"), work)
    assert recommend(on_h100, work)[0].candidate.name == "FP8+KV-FP8"  # FP8 before 4 bits


def test_target_tpot_picks_the_largest_batch_that_meets_it(llama8b):
    work = workload(context=8192, target_tpot_ms=10)
    estimates = evaluate_candidates(llama8b, accelerator("H100"), work)
    for est in estimates:
        assert est.tpot_s * 1e3 <= 10
        bigger = estimate(llama8b, accelerator("H100"), workload(context=8192, concurrency=est.batch + 1),
                          est.candidate)
        assert bigger.tpot_s * 1e3 > 10 or est.batch == est.max_concurrency
    assert recommend(estimates, work)[0].candidate.name == "BF16"  # 4.8 ms alone


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W3A16", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC"])
@pytest.mark.parametrize("shape", [(256, 768), (96, 384)])
@pytest.mark.parametrize("g_idx", [False, True])
def test_linear_bytes_equal_quantlinear_buffers(scheme, shape, g_idx):
    out, inp = shape
    module = QuantLinear(inp, out, PRESETS[scheme], bias=True, scale_dtype=torch.bfloat16, has_g_idx=g_idx)
    module.bias.data = module.bias.data.to(torch.bfloat16)  # stored in the model dtype, as ptq.save does
    real = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    assert linear_bytes(out, inp, PRESETS[scheme], dtype_bytes=2, bias=True, g_idx=g_idx) == real


@pytest.mark.parametrize("spec", [
    {"scheme": "INT4", "strategy": "kivi"}, {"scheme": "INT2", "strategy": "kivi", "group_size": 16, "residual": 64},
    {"scheme": "INT4", "strategy": "kivi", "keys": "token"}, {"scheme": "FP8", "strategy": "tensor"},
    {"scheme": "INT8", "strategy": "head"},
])
@pytest.mark.parametrize("tokens", [100, 256, 512, 700])
def test_kv_bytes_equal_the_cache_ptq_holds(spec, tokens):
    """The plan's KV bytes are what ptq's QuantizedKVCache holds (its per-layer static scales aside,
    and static caches at whole blocks of 256 tokens)."""
    spec = KVCacheScheme.model_validate(spec)
    if spec.static and tokens % 256:
        pytest.skip("static caches grow by blocks of 256 tokens")
    layers, heads, dim = 2, 2, 32
    scales = [torch.full((heads,), 0.05)] * layers if spec.static else None
    cache = QuantizedKVCache(spec, layers, scales, scales)
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, 64):  # prefill-like chunks
        n = min(64, tokens - start)
        for layer in range(layers):
            k, v = (torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16) for _ in range(2))
            cache.update(k, v, layer)
    static_scales = 2 * layers * heads * 4 if spec.static else 0
    assert kv_bytes(Attention(layers, 4, heads, dim), tokens, spec) == cache.stored_bytes() - static_scales


def header_bytes(folder):
    return sum(info["data_offsets"][1] - info["data_offsets"][0]
               for file in weight_files(folder) for name, info in safetensors_header(file).items()
               if name != "__metadata__")


RECIPES = {
    "w4a16-asym-rtn": "steps:\n  - rtn: {scheme: W4A16_ASYM}\n",
    "w4a16-gptq-actorder-group": "calibration: {samples: 2, seq_len: 64}\nsteps:\n"
                                 "  - gptq: {scheme: W4A16, actorder: group}\n",
    "w8a8-static-kv-fp8": "calibration: {samples: 2, seq_len: 64}\nsteps:\n  - rtn: {scheme: FP8}\n"
                          "kv_cache: {scheme: FP8, strategy: head}\n",
    "w3a16-rtn-no-ignore": "steps:\n  - rtn: {scheme: W3A16, ignore: []}\n",
}


def test_bundled_model_bf16_bytes_are_its_file(bundled_path):
    facts = read_model("builtin")
    bf16 = estimate(facts, accelerator("L4"), workload(context=512), STANDARD[0])
    assert bf16.weight_bytes == header_bytes(bundled_path) == facts.stored_bytes
    assert facts.parameters == 5_114_112


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_plan_bytes_equal_the_checkpoint_ptq_writes(name, tmp_path):
    """Quantize the bundled model with a recipe, save it: the plan's bytes for that recipe (from
    config.json) are the checkpoint's tensor bytes, and planning the checkpoint reads them back."""
    recipe = parse_recipe(__import__("yaml").safe_load(RECIPES[name]), name)
    model, tokenizer = ptq.load_model()
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    ptq.save(model, tmp_path / "out", tokenizer=tokenizer)
    planned = estimate(read_model("builtin"), accelerator("H100"), workload(context=512),
                       candidate_from_recipe(name, recipe))
    assert planned.weight_bytes == header_bytes(tmp_path / "out")
    facts = read_model(str(tmp_path / "out"))
    stored = by_name(evaluate_candidates(facts, accelerator("H100"), workload(context=512)))["checkpoint"]
    assert stored.weight_bytes == planned.weight_bytes
    assert stored.candidate.kv == recipe.kv_cache
    assert stored.kv_bytes_per_token == planned.kv_bytes_per_token


def test_custom_gpu_and_user_candidates(tmp_path, capsys):
    folder = config_folder(tmp_path, LLAMA3_8B)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("steps:\n  - rtn: {scheme: W8A16}\nkv_cache: {scheme: INT8, strategy: head}\n")
    code = main(["plan", str(folder), "--memory-gb", "48", "--bandwidth-gbs", "960", "--tflops", "150",
                 "--candidate", str(recipe), "--candidate", "w4a16_asym", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    rows = {c["name"]: c for c in data["candidates"]}
    assert rows["mine"]["kv_bytes_per_token"] == 64 * KIB and rows["W4A16_ASYM"]["linear_bits"] > 4.125
    assert data["accelerator"]["name"] == "custom" and rows["FP8+KV-FP8"]["kernel"] is False


def test_plot(tmp_path, capsys, monkeypatch):
    folder = config_folder(tmp_path, LLAMA3_8B)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code = main(["plan", str(folder), "--plot", str(tmp_path / "plan.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["ptq: error: --plot needs matplotlib: pip install 'ptq[plot]'"]
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert main(["plan", str(folder), "--plot", str(tmp_path / "plan.png")]) == 0
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["--gpu", "V100"], "unknown --gpu 'V100'"),
    (["--memory-gb", "40"], "needs all three of --memory-gb"),
    (["--gpu", "L4", "--tflops", "10", "--memory-gb", "1", "--bandwidth-gbs", "1"], "not both"),
    (["--context", "1000", "--prompt-tokens", "900", "--output-tokens", "200"], "exceed --context 1000"),
    (["--target-tpot-ms", "-1"], "--target-tpot-ms is -1.0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization is 1.5"),
    (["--candidate", "W9A9"], "W9A9"),
    (["--checkpoint", "x"], "--checkpoint is for --measure"),
    (["--plot", "plan.txt"], "give a .png"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    folder = config_folder(tmp_path, LLAMA3_8B)
    code = main(["plan", str(folder), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("ptq: error: ") and message in err[0], err


def test_bad_models_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    broken = config_folder(tmp_path, {"model_type": "not-a-model"}, "broken")
    for path, message in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no config.json"),
                          (broken, "not-a-model")]:
        code = main(["plan", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_engine_bench_on_the_cpu(tmp_path):
    """--measure's engine: generate timed beside the plan's bounds (tiny sizes: seconds)."""
    from ptq.engine_bench import format_measurements, run_engine_bench

    model, tokenizer = ptq.load_model()
    ptq.quantize(model, "W4A16", tokenizer=tokenizer, show_progress=False)
    ptq.save(model, tmp_path / "w4", tokenizer=tokenizer)
    bench = run_engine_bench("builtin", torch.device("cpu"), checkpoint=str(tmp_path / "w4"), batches=(2,),
                             prompts=(16,), new_tokens=3)
    assert [(m.model, m.batch, m.prompt) for m in bench.rows] == [("original", 2, 16), (str(tmp_path / "w4"), 2, 16)]
    for m in bench.rows:
        assert m.ttft_s > 0 and m.ttft_bound_s > 0 and m.tpot_bound_s > 0 and m.peak_bytes > 0
    assert "measured / bound" in format_measurements(bench) and bench.device.startswith("CPU")
