"""`mla-tune lookup` in every format, `backends`, `probe`, `--version`/`--help` and the no-GPU main job."""

from __future__ import annotations

import json
import sys

import pytest

from mla_tune.backends.device import DeviceInfo
from mla_tune.backends.engine_names import engine_best
from mla_tune.backends.problem import Problem
from mla_tune.backends.software import current_fingerprint
from mla_tune.store.records import Decision, DecisionKey
from mla_tune.store.repository import Store

H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), memory_total_mib=81559,
                  pci_device_id="0x233010DE", driver_version="580.65.06")
ON_H100 = ["--device-name", "NVIDIA H100 80GB HBM3", "--cc", "9.0"]


def save(url, *, heads, kv, winner, scores, stale=False):
    """Store a decision; `stale` ones (engine_best None) were made before vLLM's own kernels were timed."""
    key = DecisionKey.of(H100.sku, (9, 0), Problem(num_heads=heads, kv_cache_dtype=kv))
    runner_up = sorted((s, n) for n, s in scores.items() if n != winner)[0][1]
    with Store.open(url) as store:
        store.save_decision(Decision(
            key=key, winner=winner, static_choice="FLASH_ATTN_MLA" if kv == "bf16" else "FLASHMLA",
            scores=scores, runner_up=runner_up, margin=scores[runner_up] / scores[winner] - 1,
            fingerprint=current_fingerprint(driver_version=H100.driver_version),
            decided_at="2026-11-22T03:00:00Z", engine_best=None if stale else engine_best(scores)))


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    # vLLM runs none of FlashInfer's FA2/FA3 MLA under its own name; its fastest own backend here is FLASHMLA,
    # and its own Triton kernel (TRITON_MLA) is slower than ours (MLA_TUNE_TRITON).
    save(url, heads=64, kv="fp8", winner="FLASHINFER_FA3_MLA",
         scores={"FLASHINFER_FA3_MLA": 1.0, "FLASHINFER_FA2_MLA": 1.1, "FLASHMLA": 1.2, "MLA_TUNE_TRITON": 1.3,
                 "TRITON_MLA": 2.5})
    save(url, heads=16, kv="fp8", winner="MLA_TUNE_TRITON",
         scores={"MLA_TUNE_TRITON": 1.0, "FLASHMLA": 1.15, "FLASHINFER_FA3_MLA": 1.25, "TRITON_MLA": 3.0})
    # timed only backends vLLM does not run under their own names
    save(url, heads=64, kv="bf16", winner="FLASHINFER_FA3_MLA",
         scores={"FLASHINFER_FA3_MLA": 1.0, "FLASHINFER_FA2_MLA": 1.1, "MLA_TUNE_TRITON": 1.2})
    # made before vLLM's kernels were timed: its TRITON_MLA score was our kernel's
    save(url, heads=128, kv="fp8", winner="TRITON_MLA", scores={"TRITON_MLA": 1.0, "FLASHINFER_FA3_MLA": 1.2},
         stale=True)
    return url


def test_text(cli, db):
    result = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100)
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first == "FLASHINFER_FA3_MLA (tuned, margin 10.0% over FLASHINFER_FA2_MLA)"
    assert "not FLASHINFER_MLA: compute capability 9.0 is not supported" in result.stdout
    assert result.stderr == ""


def test_json(cli, db):
    result = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "json")
    data = json.loads(result.stdout)
    assert data["backend"] == "FLASHINFER_FA3_MLA" and data["source"] == "tuned"
    assert "FLASHINFER_FA2_MLA" in data["reasons"] and isinstance(data["reasons"]["FLASHINFER_FA2_MLA"], list)
    assert data["key"]["num_heads"] == 64 and data["key"]["kv_cache_dtype"] == "fp8_e4m3"


def test_vllm_gets_the_fastest_backend_it_runs_under_its_own_name(cli, db):
    # Ours won at 16 heads, but vLLM runs it only through mla-tune's plugin, which is not installed here;
    # vLLM's TRITON_MLA is vLLM's own (slower) kernel. vLLM gets FLASHMLA, and stderr says how far it is.
    result = cli("--db", db, "lookup", "--heads", "16", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "vllm")
    assert result.exit_code == 0
    assert result.stdout == "--attention-backend FLASHMLA\n"
    assert ("vLLM's fastest own backend is FLASHMLA, 1.15x the time of the fastest kernel MLA_TUNE_TRITON "
            "(MLA_TUNE_TRITON cannot go to vLLM here: ") in result.stderr
    assert "it is also vLLM's static choice" in result.stderr


def test_vllm_gets_no_flag_when_it_runs_none_of_the_timed_backends(cli, db):
    result = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "bf16", *ON_H100, "--format", "vllm")
    assert result.exit_code == 0
    assert result.stdout == ""  # `vllm serve $(mla-tune lookup ...)` then runs with vLLM's own choice
    assert "printing no flag: vLLM runs none of the timed backends under its own name" in result.stderr


def test_a_stale_decision_prints_no_flag(cli, db):
    # Its TRITON_MLA was our kernel under vLLM's name: handing it to vLLM would run vLLM's kernel.
    for fmt in ("vllm", "sglang"):
        result = cli("--db", db, "lookup", "--heads", "128", "--kv-cache-dtype", "fp8", *ON_H100, "--format", fmt)
        assert result.exit_code == 0 and result.stdout == "", fmt
        assert "printing no flag: the tuned decision was made before mla-tune timed" in result.stderr
        assert "re-run `mla-tune`" in result.stderr
    env = cli("--db", db, "lookup", "--heads", "128", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "env")
    assert env.stdout == ("MLA_TUNE_BACKEND=TRITON_MLA MLA_TUNE_SOURCE=tuned MLA_TUNE_VLLM_BACKEND='' "
                          "MLA_TUNE_SGLANG_BACKEND=''\n")


def test_sglang_names(cli, db):
    result = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "sglang")
    assert result.stdout == "--attention-backend flashinfer\n"  # SGLang runs FlashInfer's FA3 MLA as flashinfer
    ours = cli("--db", db, "lookup", "--heads", "16", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "sglang")
    # SGLang's fastest backend among the timed ones it runs: FlashInfer's kernel, not vLLM's FlashMLA build
    # (faster here, but timed through vLLM's code, which SGLang does not run).
    assert ours.stdout == "--attention-backend flashinfer\n"


def test_env_line(cli, db):
    result = cli("--db", db, "lookup", "--heads", "16", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "env")
    assert result.stdout == ("MLA_TUNE_BACKEND=MLA_TUNE_TRITON MLA_TUNE_SOURCE=tuned MLA_TUNE_VLLM_BACKEND=FLASHMLA "
                             "MLA_TUNE_SGLANG_BACKEND=flashinfer\n")


def test_fallback_prints_no_engine_flag(cli, db):
    result = cli("--db", db, "lookup", "--heads", "32", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "vllm")
    assert result.exit_code == 0 and result.stdout == ""
    assert "printing no flag: nothing tuned (no tuned decision for fp8_e4m3 kv, 32 heads" in result.stderr
    assert "vLLM makes its own choice (vLLM's static priority gives FLASHMLA)" in result.stderr


@pytest.mark.parametrize("content", [b"not a database at all" * 100, b""], ids=["garbage", "empty"])
def test_unusable_store_is_a_warning_and_exit_0(cli, tmp_path, content, files_under):
    path = tmp_path / "bad.db"
    path.write_bytes(content)
    before = files_under(tmp_path)
    result = cli("--db", f"sqlite:///{path}", "lookup", "--heads", "64", "--kv-cache-dtype", "bf16", *ON_H100,
                 "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["source"] == "fallback"
    assert json.loads(result.stdout)["backend"] == "FLASH_ATTN_MLA"
    warning = result.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("mla-tune: warning: ")
    assert files_under(tmp_path) == before


def test_missing_default_store_is_not_created(cli, isolated_store):
    result = cli("lookup", "--heads", "128", "--kv-cache-dtype", "auto", *ON_H100, "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["source"] == "fallback"
    assert "no database at" in result.stderr
    assert not isolated_store.exists()


def test_lookup_without_gpu_or_device_is_one_line_exit_1(cli, no_gpu):
    result = cli("lookup", "--heads", "64", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "--device-name" in result.stderr


def test_backends_lists_every_backend_with_eligible_or_reasons(cli):
    from mla_tune.backends.registry import BACKENDS

    result = cli("backends", "--cc", "9.0", "--heads", "64", "--kv-cache-dtype", "fp8", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    rows = {row["backend"]: row for row in data["backends"]}
    assert set(rows) == set(BACKENDS)
    assert rows["MLA_TUNE_TRITON"]["eligible"] and rows["MLA_TUNE_TRITON"]["reasons"] == []
    if not _vllm_installed():   # vLLM's own kernels need vLLM
        assert rows["TRITON_MLA"]["reasons"][-1].startswith("vllm is not installed (")
    assert rows["FLASHINFER_MLA"]["reasons"][0] == "compute capability 9.0 is not supported (needs major {10})"
    assert rows["FLASH_ATTN_MLA"]["reasons"][0] == "kv_cache_dtype fp8_e4m3 not in {bf16, fp16}"
    text = cli("backends", "--cc", "10.0", "--heads", "96")
    assert text.exit_code == 0 and "eligible" in text.stdout and "num_heads 96 is in 65..127" in text.stdout


def test_backends_without_gpu_skips_device_checks_with_a_warning(cli, no_gpu):
    result = cli("backends", "--sparse", "--json")
    assert result.exit_code == 0
    assert "device checks skipped" in result.stderr
    rows = {row["backend"]: row for row in json.loads(result.stdout)["backends"]}
    assert rows["MLA_TUNE_TRITON"]["reasons"] == ["sparse attention (top-k 2048) is not supported"]
    assert rows["TRITON_MLA"]["reasons"][0] == "sparse attention (top-k 2048) is not supported"
    if not _vllm_installed():  # one sentence for the absent package, not one per missing file of it
        assert len(rows["TRITON_MLA"]["reasons"]) == 2
        assert rows["TRITON_MLA"]["reasons"][1].startswith("vllm is not installed (")
    # SM100-only, but the device is not checked (a missing flashinfer may still be a reason)
    assert not [r for r in rows["FLASHINFER_MLA_SPARSE"]["reasons"] if "compute capability" in r]


def _vllm_installed() -> bool:
    from importlib import metadata

    try:
        return bool(metadata.version("vllm"))
    except metadata.PackageNotFoundError:
        return False


def test_probe_without_a_driver_is_one_line_exit_1(cli, no_gpu):
    result = cli("probe")
    assert result.exit_code == 1
    assert result.stderr.startswith("mla-tune: error: no NVIDIA GPU found") and result.stderr.count("\n") == 1


def test_probe_with_a_fake_nvml(cli, monkeypatch):
    import nvml_fake

    monkeypatch.setitem(sys.modules, "pynvml", nvml_fake.FakeNVML([nvml_fake.gpu(), nvml_fake.gpu(uuid="GPU-2")]))
    data = json.loads(cli("probe", "--json").stdout)
    assert [d["sku"] for d in data] == ["NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x233010DE"] * 2
    monkeypatch.setenv("COLUMNS", "160")   # the width of piped output: the name on one line
    table = cli("probe")
    assert table.exit_code == 0 and "NVIDIA H100 80GB HBM3" in table.stdout


def test_version_and_help(cli):
    from mla_tune import __version__

    assert cli("--version").stdout == f"mla-tune {__version__}\n"
    for flag in ("-h", "--help"):
        result = cli(flag)
        assert result.exit_code == 0 and "lookup" in result.stdout and "Example:" in result.stdout
    for command in (["lookup"], ["backends"], ["probe"], ["show"], ["db", "upgrade"]):
        result = cli(*command, "-h")
        assert result.exit_code == 0 and "Example:" in result.stdout, command


def test_main_job_without_gpu_says_so_and_shows_static_choices(cli, isolated_store, no_gpu, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")   # the width of piped output: every cell on one line
    result = cli()
    assert result.exit_code == 0
    assert result.stdout.startswith("No NVIDIA GPU here")
    # vLLM 0.33.0 prefers FA4 sparse at 16 heads per rank on SM100 (bf16 KV), FlashMLA sparse above
    for text in ("NVIDIA H100 80GB HBM3", "NVIDIA B200", "FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA",
                 "128/64/32 heads: FLASHMLA_SPARSE; 16 heads: FLASH_ATTN_MLA_SPARSE_FA4"):
        assert text in result.stdout
    assert not isolated_store.exists()


def test_engine_ranks_only_the_engines_backends(cli, db):
    # The 64-head winner FLASHINFER_FA3_MLA has no vLLM name: --format vllm and --engine vllm both give the
    # best-scoring backend vLLM runs under its own name (FLASHMLA, 1.2), never vLLM's slower TRITON_MLA.
    plain = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100, "--format", "vllm")
    ranked = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100,
                 "--format", "vllm", "--engine", "vllm")
    for result in (plain, ranked):
        assert result.exit_code == 0 and result.stdout == "--attention-backend FLASHMLA\n"
        assert "vLLM's fastest own backend is FLASHMLA, 1.20x the time of the fastest kernel FLASHINFER_FA3_MLA" \
            in result.stderr
    text = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100, "--engine", "vllm")
    assert text.stdout.splitlines()[0].startswith("FLASHINFER_FA3_MLA (tuned")   # the fastest kernel stays first
    assert "  for vllm: FLASHMLA (vLLM's fastest own backend is FLASHMLA" in text.stdout
    data = json.loads(cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100,
                          "--format", "json", "--engine", "sglang").stdout)
    assert data["backend"] == "FLASHINFER_FA3_MLA"
    assert data["engine"]["engine_backend"] == "flashinfer" and data["engine"]["basis"] == "winner"


def test_engine_and_another_engines_format_is_a_usage_error(cli, db):
    result = cli("--db", db, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8", *ON_H100,
                 "--format", "sglang", "--engine", "vllm")
    assert result.exit_code == 2 and "cannot go with --engine vllm" in result.stderr
