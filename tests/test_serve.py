"""The OpenAI-compatible endpoint against the official ``openai`` client: completions and
chat completions (plain and streamed, sync and async clients), the token rule, episodes
refused once closed, and many concurrent requests batched into few generate calls."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from serve_helpers import MODEL, ThreadedGenerator, make_state, serving, tiny_engine


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def run(coro):
    return asyncio.run(coro)


def test_async_client_completions_and_chat_carry_tokens_logprobs_and_version(engine):
    async def main():
        gen = ThreadedGenerator(engine)
        state = make_state(gen, engine.tokenizer)
        async with serving(state) as (url, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            done = await client.completions.create(model=MODEL, prompt="1+1=", max_tokens=5, seed=3)
            ext = done.model_extra["loomrl"]["choices"][0]
            assert ext["prompt_token_ids"] == engine.tokenizer("1+1=")["input_ids"]
            assert len(ext["token_ids"]) == len(ext["logprobs"]) == len(ext["versions"]) >= 1
            assert ext["versions"] == [engine.version] * len(ext["token_ids"])
            assert all(lp <= 0.0 for lp in ext["logprobs"])
            text = engine.tokenizer.decode(ext["token_ids"], skip_special_tokens=True)
            assert done.choices[0].text == text
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                logprobs=True,
            )
            ext = chat.model_extra["loomrl"]["choices"][0]
            assert chat.choices[0].message.role == "assistant"
            got = [t.logprob for t in chat.choices[0].logprobs.content]
            assert got == ext["logprobs"]
            assert chat.usage.completion_tokens == len(ext["token_ids"])

    run(main())


def test_the_same_seed_gives_the_same_completion_as_the_engine_directly(engine):
    from loomrl.types import GenerationRequest, SamplingParams

    prompt = engine.tokenizer("7*3=")["input_ids"]
    direct = engine.generate([GenerationRequest(prompt, 1, SamplingParams(0.8, 1.0, 6), 11)])[0]

    async def main():
        state = make_state(ThreadedGenerator(engine), engine.tokenizer)
        async with serving(state) as (url, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
            done = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=11
            )
            return done.model_extra["loomrl"]["choices"][0]

    ext = run(main())
    assert ext["token_ids"] == direct.token_ids[0]
    assert ext["logprobs"] == direct.logprobs[0]


def test_sync_client_and_streaming_from_another_thread(engine):
    """The sync client (in a thread: the server runs on this test's loop), plain and streamed."""

    async def main():
        state = make_state(ThreadedGenerator(engine), engine.tokenizer)
        async with serving(state) as (url, _):
            out = {}

            def use_sync_client():
                client = openai.OpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
                out["plain"] = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=6, seed=5
                )
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "a"}],
                    max_tokens=6,
                    seed=5,
                    stream=True,
                )
                out["chunks"] = list(stream)
                out["text_stream"] = list(
                    client.completions.create(
                        model=MODEL, prompt="ab", max_tokens=5, seed=2, stream=True
                    )
                )

            thread = threading.Thread(target=use_sync_client)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.01)
            return out

    out = run(main())
    plain, chunks = out["plain"], out["chunks"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].model_extra["loomrl"] == plain.model_extra["loomrl"] | {"episode_id": None}
    text = "".join(c.choices[0].text for c in out["text_stream"] if c.choices)
    ext = out["text_stream"][-1].model_extra["loomrl"]["choices"][0]
    assert text == engine.tokenizer.decode(ext["token_ids"], skip_special_tokens=True)


def test_every_request_needs_the_jobs_token(engine):
    async def main():
        state = make_state(ThreadedGenerator(engine), engine.tokenizer)
        async with serving(state) as (url, _):
            body = {"model": MODEL, "prompt": "1", "max_tokens": 2}
            async with httpx.AsyncClient() as http:
                none = await http.post(url + "/v1/completions", json=body)
                other = await http.post(
                    url + "/v1/completions",
                    json=body,
                    headers={"Authorization": "Bearer another-jobs"},
                )
                health = await http.get(url + "/healthz")
                oversized = await http.post(
                    url + "/v1/completions",
                    content=b"x" * (state.max_body_bytes + 1),
                    headers={"Authorization": f"Bearer {state.token}"},
                )
                malformed = await http.post(
                    url + "/v1/completions",
                    content=b"{not json",
                    headers={"Authorization": f"Bearer {state.token}"},
                )
            with pytest.raises(openai.PermissionDeniedError):
                await openai.AsyncOpenAI(
                    base_url=url + "/v1", api_key="x", max_retries=0
                ).models.list()
            return none, other, health, oversized, malformed, state.policy.batcher.num_calls

    none, other, health, oversized, malformed, calls = run(main())
    assert (none.status_code, other.status_code) == (401, 403)
    assert none.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert (oversized.status_code, malformed.status_code) == (413, 400)
    assert calls == 0


def test_requests_for_unknown_or_closed_episodes_are_refused(engine):
    async def main():
        state = make_state(ThreadedGenerator(engine), engine.tokenizer)
        async with serving(state) as (url, _):
            root = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
            opened = await root.post("/episodes", body={}, cast_to=object)
            bound = openai.AsyncOpenAI(
                base_url=url + opened["base_path"], api_key=state.token, max_retries=0
            )
            await bound.completions.create(model=MODEL, prompt="2+2=", max_tokens=3)
            closed = await root.post(
                f"/episodes/{opened['id']}/reward", body={"reward": 1.0}, cast_to=object
            )
            with pytest.raises(openai.ConflictError, match="is closed"):
                await bound.completions.create(model=MODEL, prompt="2+2=", max_tokens=3)
            unknown = openai.AsyncOpenAI(
                base_url=url + "/e/ep-nope/v1", api_key=state.token, max_retries=0
            )
            with pytest.raises(openai.NotFoundError, match="no episode"):
                await unknown.completions.create(model=MODEL, prompt="1", max_tokens=2)
            with pytest.raises(openai.NotFoundError, match="no episode"):
                await root.completions.create(
                    model=MODEL,
                    prompt="1",
                    max_tokens=2,
                    extra_headers={"X-Loomrl-Episode": "ep-nope"},
                )
            return closed

    assert run(main())["requests"] == 1


def test_concurrent_requests_share_generate_calls(engine):
    async def main():
        gen = ThreadedGenerator(engine)
        state = make_state(gen, engine.tokenizer, window_s=0.05)
        async with serving(state) as (url, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
            done = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"{i}+", max_tokens=3, seed=i)
                    for i in range(40)
                )
            )
        return gen.batch_sizes, done

    sizes, done = run(main())
    assert sum(sizes) == 40 and len(done) == 40
    assert len(sizes) < 40
