"""Speculative decoding in the engine (engine/speculative.py), on the stub: n-gram proposals,
the same tokens as decoding one at a time (greedy and seeded sampling), fewer steps where
the output copies its prompt, and the blocks of tokens not kept given back at once, on
rejection, on preemption and on a hang-up, by their exact ids.

The copy workload is the stub told to say (`⟪say⟫...⟪/say⟫`) a JSON object its prompt
holds with one field changed: the n-gram proposals come from the prompt's copy, and the
changed field is where one is rejected."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.drain import drain, tokens

from nanoserve.config import ConfigError, EngineConfig, SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.speculative import ngram_proposal
from nanoserve.model.stub import StubModel
from nanoserve.sampling.grammar import GuidedSpec
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer

SOURCE = '{"name": "nanoserve", "version": 3, "license": "MIT"}'
EDIT = SOURCE.replace('"version": 3', '"version": 4')
GREEDY = SamplingParams(temperature=0.0, max_tokens=60)
# Always 4 tokens where the n-gram has them (vLLM's rule): the mechanics' tests count on it.
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                          adaptive=False)
ADAPTIVE = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from nanoserve.model.loader import resolve_model

    return Tokenizer.from_folder(resolve_model("smollm2"))


def make(tok: Tokenizer, spec: SpeculativeConfig | None, **cfg: object) -> Engine:
    base: dict[str, object] = {"block_size": 4, "num_blocks": 64, **cfg}
    return Engine(StubModel(tok, max_position_embeddings=256), tok,
                  EngineConfig(speculative=spec, **base))  # type: ignore[arg-type]


def copy_prompt(tok: Tokenizer) -> list[int]:
    """The stub says EDIT; the prompt's SOURCE, after the script, is where proposals come
    from (the latest occurrence), so the changed field is proposed wrong once."""
    return tok.encode(f"⟪say⟫{EDIT}⟪/say⟫ Rewrite this JSON with version 4: {SOURCE}\n")


def outputs(tok: Tokenizer, spec: SpeculativeConfig | None, prompts: list[list[int]],
            params: SamplingParams, **cfg: object) -> tuple[dict[str, list[int]], Engine]:
    e = make(tok, spec, **cfg)
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    return tokens(drain(e)), e


def test_ngram_proposal_takes_the_longest_ngram_and_its_latest_full_continuation() -> None:
    assert ngram_proposal([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    # "2 3" occurs at 1 and 5; the latest with 4 tokens after it wins.
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 4, 2, 4) == [7, 5, 2, 3]
    # The longest n-gram first: "9 2 3" occurs once, before "8".
    assert ngram_proposal([9, 2, 3, 8, 4, 2, 3, 6, 9, 2, 3], 2, 2, 3) == [8, 4]
    # Where no match has k tokens after it, the earliest (the most).
    assert ngram_proposal([5, 5, 5, 5], 3, 1, 3) == [5]
    assert ngram_proposal([1, 2, 3], 3, 2, 4) == []  # nothing occurs twice
    assert ngram_proposal([1, 2, 1, 2], 0, 2, 4) == []


def test_speculative_config_errors_name_the_field() -> None:
    def refused(text: str) -> str:
        with pytest.raises(ConfigError) as exc:
            SpeculativeConfig.parse(text)
        return str(exc.value)

    assert "speculative_config.method" in refused('{"method": "eagle"}')
    assert "speculative_config.num_speculative_tokens" in refused(
        '{"num_speculative_tokens": 0}')
    assert "only of it" in refused('{"method": "ngram", "model": "x"}')
    assert "only of it" in refused('{"method": "draft_model"}')
    assert "speculative_config.model must be" in refused('{"model": ""}')
    assert SpeculativeConfig.parse('{"model": "x"}').method == "draft_model"  # as vLLM infers
    assert "exceeds prompt_lookup_max" in refused(
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 3}')
    assert "not valid JSON" in refused("{method: ngram}")
    # vLLM's shape: prompt_lookup_max alone.
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_max": 5}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 2, 5)


def test_copying_output_takes_fewer_steps_with_the_same_tokens(tok: Tokenizer) -> None:
    plain, e0 = outputs(tok, None, [copy_prompt(tok)], GREEDY)
    spec, e1 = outputs(tok, NGRAM, [copy_prompt(tok)], GREEDY)
    assert spec == plain
    assert tok.decode(plain["r0"]) == EDIT  # then EOS, which decodes to nothing
    assert len(plain["r0"]) == 21
    assert (e0.num_steps, e1.num_steps) == (21, 7)
    s = e1.spec
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (5, 20, 14)
    assert s.accepted_per_position == [4, 4, 3, 3]
    assert e0.spec.drafts == 0


def test_a_constraint_cuts_a_proposal_before_it_is_checked(tok: Tokenizer) -> None:
    """A structured-output request speculates too: its proposal is cut at the first token
    its constraint refuses (the JSON object is complete: nothing but its end may follow),
    and each checked row is masked as decoding would mask it there. The same object, in 7
    steps instead of 20; 18 tokens proposed where the unconstrained request had 20."""
    schema = {"type": "object", "required": ["name", "version", "license"],
              "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "version": {"type": "integer"},
                             "license": {"type": "string"}}}
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            guided=GuidedSpec.json_schema(schema))
    plain, e0 = outputs(tok, None, [copy_prompt(tok)], params)
    spec, e1 = outputs(tok, NGRAM, [copy_prompt(tok)], params)
    assert spec == plain
    assert tok.decode(spec["r0"]) == EDIT
    assert (e0.num_steps, e1.num_steps) == (20, 7)
    assert (e1.spec.drafts, e1.spec.draft_tokens, e1.spec.accepted_tokens) == (5, 18, 14)


def test_adaptive_proposals_grow_where_kept_and_stop_where_not(tok: Tokenizer) -> None:
    """The default policy: a request's proposals as long as its own record says pays
    (speculative.proposal_length). On the copy prompt they start at one token and grow as
    they are kept; on text the stub does not repeat, they stop after a few rejections where
    vLLM's rule keeps proposing 4 at every n-gram hit. The tokens are the same either way."""
    copy, e = outputs(tok, ADAPTIVE, [copy_prompt(tok)], GREEDY)
    plain, _ = outputs(tok, None, [copy_prompt(tok)], GREEDY)
    assert copy == plain
    assert e.num_steps == 8
    assert (e.spec.drafts, e.spec.draft_tokens, e.spec.accepted_tokens) == (6, 17, 13)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=120, ignore_eos=True)
    text = [tok.encode("def step(self):\n    return self.schedule()\n" * 2)]
    fixed, e_fixed = outputs(tok, NGRAM, text, params)
    adaptive, e_adaptive = outputs(tok, ADAPTIVE, text, params)
    assert adaptive == fixed
    # Four proposals of 4, none kept, against three of one token: the rate fell below what
    # a one-token proposal pays for (0.3 and up) after the third, then drifts back slowly.
    assert (e_fixed.spec.drafts, e_fixed.spec.draft_tokens, e_fixed.spec.accepted_tokens) == \
        (4, 16, 0)
    assert (e_adaptive.spec.drafts, e_adaptive.spec.draft_tokens,
            e_adaptive.spec.accepted_tokens) == (3, 3, 0)


@pytest.mark.parametrize(("temperature", "frequency", "seed"),
                         [(1.0, 0.0, 3), (1.0, 0.0, 11), (0.5, 0.4, 3)])
def test_a_seeded_sampled_output_is_the_same_token_for_token(
        tok: Tokenizer, temperature: float, frequency: float, seed: int) -> None:
    """Each row is drawn as decoding draws it, with the uniform of (seed, index), and a
    penalty sees the proposal's tokens before the row as output: the same tokens, only
    fewer steps where the proposals are drawn."""
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=80,
                            ignore_eos=True, frequency_penalty=frequency)
    accepted = 0
    for text in (f"⟪say⟫{EDIT}⟪/say⟫ {SOURCE}", "def step(self):\n    return self.schedule()\n"):
        plain, e0 = outputs(tok, None, [tok.encode(text * 2)], params)
        spec, e1 = outputs(tok, NGRAM, [tok.encode(text * 2)], params)
        assert spec == plain
        assert e1.num_steps == e0.num_steps - e1.spec.accepted_tokens
        accepted += e1.spec.accepted_tokens
    assert accepted > 0


def test_requests_with_and_without_proposals_share_a_batch(tok: Tokenizer) -> None:
    off = SamplingParams(temperature=0.0, max_tokens=60, speculate=False)
    e = make(tok, NGRAM)
    e.add_request(copy_prompt(tok), GREEDY, "on")
    e.add_request(copy_prompt(tok), off, "off")
    got = tokens(drain(e))
    solo, _ = outputs(tok, None, [copy_prompt(tok)], GREEDY)
    assert got == {"on": solo["r0"], "off": solo["r0"]}
    assert e.num_steps == 21  # the one that does not speculate sets the pace
    assert e.spec.accepted_tokens == 14


def test_no_proposal_past_max_tokens_or_past_a_stop(tok: Tokenizer) -> None:
    for params in (SamplingParams(temperature=0.0, max_tokens=9),
                   SamplingParams(temperature=0.0, max_tokens=60,
                                  stop_token_ids=(tok.encode(EDIT)[10],))):
        plain, _ = outputs(tok, None, [copy_prompt(tok)], params)
        spec, e = outputs(tok, NGRAM, [copy_prompt(tok)], params)
        assert spec == plain
        assert e.pool.num_free == 64


def test_a_rejected_proposal_gives_its_block_back_at_once(tok: Tokenizer) -> None:
    e = make(tok, NGRAM)
    e.add_request(copy_prompt(tok), GREEDY, "r")
    req = e.requests["r"]
    for _ in range(4):
        e.step()
    # 76 tokens computed, in 19 blocks: 0..18. The proposal of 4 takes positions 76..80:
    # blocks 19 and 20. It is rejected at its first token (the version), so only 77 are
    # computed: block 20 holds nothing kept and is free again, at the front of the list.
    assert (req.num_computed, req.blocks) == (76, list(range(19)))
    r = e.step()
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (4, 0)
    assert req.num_computed == 77
    assert req.blocks == list(range(20))
    assert e.pool.ref_count(20) == 0
    assert e.pool.free_list()[0] == 20


def test_a_proposal_never_preempts_and_a_preempted_one_frees_every_block(
        tok: Tokenizer) -> None:
    """Two copying requests in a pool with no room to spare: a proposal that does not fit is
    dropped rather than take a neighbour's blocks; where a request's own next token needs
    a block, the most recent request is preempted, proposal and all, and every block is
    free at the end. The tokens are those of a pool with room."""
    prompts = [copy_prompt(tok), copy_prompt(tok)]
    roomy, _ = outputs(tok, None, prompts, GREEDY)
    tight, e = outputs(tok, NGRAM, prompts, GREEDY, num_blocks=40, max_model_len=128)
    assert tight == roomy
    assert e.statistics().preemptions == 1
    assert e.spec.accepted_tokens > 0
    assert e.pool.num_free == 40
    assert all(e.pool.ref_count(b) == 0 for b in range(40))


def test_a_hang_up_after_a_speculative_step_frees_every_block(tok: Tokenizer) -> None:
    e = make(tok, NGRAM)
    e.add_request(copy_prompt(tok), GREEDY, "r")
    for _ in range(3):
        e.step()
    assert e.spec.accepted_tokens == 4
    req = e.requests["r"]
    held = list(req.blocks)
    assert held == list(range(18))  # 71 tokens computed
    (u,) = e.abort_request("r")
    assert u.finish_reason == "abort"
    assert e.pool.num_free == 64
    # Its last block, partly filled and so holding no named prefix, is handed out first;
    # its 17 full blocks, named for the prefix cache, last, the tail before the head.
    free = e.pool.free_list()
    assert free[0] == 17
    assert free[-17:] == list(range(16, -1, -1))


def test_real_weights_greedy_output_is_the_same_with_proposals(
        smollm2_any: object, smollm2_tokenizer: Tokenizer) -> None:
    """SmolLM2, float32 and on its GGUF's blocks: a row checked inside a chunk of k + 1
    gets the logits it gets alone (the kernels' rows do not depend on their neighbours),
    so the greedy tokens are decoding's, on copy prompts where most proposals are kept."""
    from nanoserve.workloads import copy_prompts

    tok = smollm2_tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=48)
    prompts = [tok.encode_prompt(copy_prompts()[i]) for i in (0, 13, 26)]
    got = {}
    for spec in (None, NGRAM):
        e = Engine(smollm2_any, tok, EngineConfig(block_size=16, num_blocks=64,  # type: ignore[arg-type]
                                                   max_model_len=1024, speculative=spec))
        for i, p in enumerate(prompts):
            e.add_request(p, params, f"r{i}")
        got[spec is not None] = tokens(drain(e))
        if spec is not None:
            assert e.spec.accepted_tokens > e.spec.draft_tokens // 2
    assert got[True] == got[False]


def test_a_proposal_takes_only_blocks_no_running_request_needs() -> None:
    """The last free block goes to a running request's own next token, not to a neighbour's
    proposal: proposals are placed after every running request has its token. A decodes
    inside its blocks and proposes 4 tokens, which would need a third block; B's next token
    needs one. One block is free: B gets it, A's proposal is dropped, nobody is preempted."""
    from nanoserve.engine.kv import BlockPool, KVManager
    from nanoserve.engine.request import Request, Status
    from nanoserve.engine.scheduler import Scheduler

    kv = KVManager(BlockPool(5, 4, prefix_caching=False))
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a = Request("a", list(range(100, 105)), GREEDY, 8, seed=0, admission=0)
    b = Request("b", list(range(200, 208)), GREEDY, 8, seed=1, admission=1)
    for r, computed in ((a, 5), (b, 8)):
        r.token_ids.append(7)  # its first output token, not yet computed
        r.num_computed = computed
        r.blocks = kv.pool.allocate(2)
        r.status = Status.RUNNING
        s.running.append(r)
    a.draft = [1, 2, 3, 4]
    schedule = s.place_proposals(s.schedule())  # as Engine.step does
    assert [(x.request.request_id, x.num_tokens) for x in schedule.scheduled] == \
        [("a", 1), ("b", 1)]
    assert schedule.preempted == ()
    assert (a.draft, a.blocks, b.blocks) == ([], [0, 1], [2, 3, 4])


def test_sim_takes_the_speculative_config_as_an_engine_setting() -> None:
    """`sim capacity|profile|validate --engine speculative_config={...}`: vLLM's JSON, as
    serve's flag takes it, and a bad one a ValueError (one line, exit 2) naming it."""
    from sim.cli_util import engine_config

    c = engine_config(['speculative_config={"method": "ngram", "num_speculative_tokens": 8, '
                       '"prompt_lookup_max": 3}'])
    assert c.speculative == SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="speculative_config.method"):
        engine_config(['speculative_config={"method": "eagle"}'])


# -- draft models ---------------------------------------------------------------------------


def _tiny_checkpoint(folder: Path, smollm2_folder: Path, seed: int, layers: int) -> str:
    """A tiny random Llama written by transformers' own classes, with SmolLM2's tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than init scale: outputs that depend on the context
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory, smollm2_folder: Path
              ) -> tuple[str, str]:
    """A target (two layers) and an unrelated draft (one layer, another seed)."""
    root = tmp_path_factory.mktemp("drafts")
    return (_tiny_checkpoint(root / "target", smollm2_folder, seed=0, layers=2),
            _tiny_checkpoint(root / "draft", smollm2_folder, seed=1, layers=1))


def _draft_run(target: str, spec: SpeculativeConfig | None, prompts: list[list[int]],
               params: SamplingParams) -> tuple[dict[str, list[int]], Engine]:
    from nanoserve.model import load

    model, tok = load(target)
    e = Engine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_model_len=256,
                                        speculative=spec))
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    return tokens(drain(e)), e


@pytest.mark.parametrize("draft", ["itself", "unrelated"])
def test_a_draft_models_proposals_keep_the_targets_greedy_tokens(
        tiny_pair: tuple[str, str], tok: Tokenizer, draft: str) -> None:
    """The draft proposes by greedy decoding in its own cache; the target keeps its own
    tokens. A draft that is the target has every proposal kept (four tokens a step and the
    bonus); an unrelated one has few kept, and the output is the same either way."""
    target, other = tiny_pair
    path = target if draft == "itself" else other
    spec = SpeculativeConfig.parse({"model": path, "num_speculative_tokens": 4,
                                    "adaptive": False})
    prompts = [tok.encode("The capital of France is"), tok.encode("def add(a, b):")]
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    want, plain = _draft_run(target, None, prompts, params)
    got, e = _draft_run(target, spec, prompts, params)
    assert got == want
    assert e.drafter is not None
    kept, proposed = e.spec.accepted_tokens, e.spec.draft_tokens
    if draft == "itself":
        assert kept == proposed == 2 * 16  # 1 + 5 + 5 + 5 + 5 tokens a request
        assert e.num_steps == 5 < plain.num_steps == 21
    else:
        assert proposed > 0
        assert kept < proposed // 2
    # every request's blocks are back in the draft's pool
    assert e.drafter.seqs == {}
    assert e.drafter.pool.num_free == 128


def test_a_hang_up_gives_the_drafts_blocks_back(tiny_pair: tuple[str, str],
                                                tok: Tokenizer) -> None:
    from nanoserve.model import load

    target, other = tiny_pair
    model, _ = load(target)
    spec = SpeculativeConfig.parse({"model": other, "num_speculative_tokens": 3})
    e = Engine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_model_len=256,
                                        speculative=spec))
    e.add_request(tok.encode("one two three four five"), SamplingParams(max_tokens=50), "a")
    for _ in range(3):
        e.step()
    assert e.drafter is not None
    held = list(e.drafter.seqs["a"].blocks)
    assert held
    e.abort_request("a")
    assert e.drafter.seqs == {}
    assert e.drafter.pool.num_free == 128
    assert set(held) <= set(e.drafter.pool.free_list())


def test_a_draft_with_another_tokenizer_is_refused(tiny_pair: tuple[str, str], tok: Tokenizer,
                                                   tmp_path: Path) -> None:
    import json
    import shutil

    from nanoserve.model import load

    target, other = tiny_pair
    changed = tmp_path / "changed"
    shutil.copytree(other, changed)
    vocab = json.loads((changed / "tokenizer.json").read_text())
    model_vocab = vocab["model"]["vocab"]  # two words trade ids: the same size, other ids
    a, b = [w for w in model_vocab if w.isalpha() and len(w) > 3][:2]
    model_vocab[a], model_vocab[b] = model_vocab[b], model_vocab[a]
    (changed / "tokenizer.json").write_text(json.dumps(vocab))
    model, _ = load(target)
    spec = SpeculativeConfig.parse({"model": str(changed)})
    with pytest.raises(ConfigError, match="speculative_config.model .* does not share"):
        Engine(model, tok, EngineConfig(block_size=4, num_blocks=16, max_model_len=64,
                                        speculative=spec))


def test_a_failing_draft_costs_its_proposals_not_the_step(tiny_pair: tuple[str, str],
                                                          tok: Tokenizer) -> None:
    from nanoserve.model import load

    target, other = tiny_pair
    spec = SpeculativeConfig.parse({"model": other, "num_speculative_tokens": 3,
                                    "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = tok.encode("one two three four five")
    want, _ = _draft_run(target, None, [prompt], params)
    model, _ = load(target)
    e = Engine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_model_len=256,
                                        speculative=spec))
    assert e.drafter is not None

    def broken(batch: object) -> object:
        raise RuntimeError("the draft's forward failed")

    e.drafter.model.forward = broken  # type: ignore[method-assign]
    e.add_request(prompt, params, "r0")
    assert tokens(drain(e)) == want
    assert e.spec.draft_tokens == 0
    assert e.drafter.seqs == {}
    assert e.drafter.pool.num_free == 128


def test_a_drafts_cache_cut_back_proposes_what_a_fresh_one_does(
        tiny_pair: tuple[str, str], tok: Tokenizer) -> None:
    """After the target keeps part of a proposal (or all of it, or none), and steps without
    proposals add tokens, the draft's cache holds the kept tokens' K/V and none of the
    refused ones': its next proposal is the one a draft that never proposed before makes
    from the same tokens."""
    from nanoserve.engine.draft import DraftProposer
    from nanoserve.model import load

    _, other = tiny_pair

    def proposer() -> DraftProposer:
        return DraftProposer(load(other)[0], 64, 4, 49152)

    tokens = tok.encode("one two three four five")
    cached = proposer()
    last = cached.propose("a", tokens, 4)
    for kept in (1, 4, 0):  # of the last proposal's four, then the target's own token,
        assert len(last) == 4  # then two more of steps that proposed nothing
        tokens = tokens + last[:kept] + [(last[kept] + 1) % 49152 if kept < 4 else 7, 11, 12]
        want = proposer().propose("a", tokens, 4)
        assert cached.propose("a", tokens, 4) == want
        assert cached.seqs["a"].ids == tokens + want[:3]
        last = want
