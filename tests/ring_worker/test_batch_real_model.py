"""The real default model (SmolLM2-135M-Instruct): a batch gives each document the greedy answer
it gets alone, whatever joins beside it (real weights have near-ties that tiny models lack)."""

from importlib.resources import files

import pytest

from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.engines import Engine
from ring_worker.engine.models import load_for_this_device

DEMO = files("cli").joinpath("demo/document.md").read_text()
QUESTIONS = [
    "What destroyed John Rudyerd's wooden lighthouse in 1755?",
    "Summarise this in one sentence.",
    "Who is named first?",
]
MAX_TOKENS = 12
CHUNK_TOKENS = 128


@pytest.mark.slow
def test_smollm2_batched_answers_match_alone():
    source = resolve_model("smollm2", allowed_dirs=None)
    model, tokenizer = load_for_this_device(source), load_tokenizer(source)
    prompts = [
        tokenizer.chat_tokens(
            [{"role": "user", "content": f"{DEMO[i * 400 : i * 400 + 600]}\n\n{q}"}]
        )
        for i, q in enumerate(QUESTIONS)
    ]
    engine = Engine(model)
    alone = [engine.decode(engine.prefill(p, CHUNK_TOKENS), MAX_TOKENS).tokens for p in prompts]
    decoder = BatchDecoder(engine)
    results = {}
    for index, prompt in enumerate(prompts):  # each joins while the earlier ones decode
        request = DecodeRequest(str(index), MAX_TOKENS)
        decoder.add(request, engine.prefill(prompt, CHUNK_TOKENS))
        for _ in range(3):
            results.update({r.key: r.tokens for r in decoder.step()})
    results.update({r.key: r.tokens for r in decoder.run()})
    assert [results[str(i)] for i in range(len(prompts))] == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # three different answers
