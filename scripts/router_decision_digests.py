"""Digests of router decisions over random fleets, policies and configurations: run it with two trees' code on the
path and compare the outputs, line for line, to show that a change to the router decides exactly as before.

    PYTHONPATH=/path/to/old python scripts/router_decision_digests.py > old.txt
    PYTHONPATH=. python scripts/router_decision_digests.py > new.txt && diff old.txt new.txt

Each line is ``seed workers policy config digest``: the digest covers every decision's worker, overlap, kind and
reason over 300 requests (shared prefixes, KV events with removals that leave holes, load reports, pins, excluded
workers, first tokens and finishes in random order). Uses only the router's public API, so it runs against older
trees too; ~1 minute on one core.

``--packed`` hands each request's prompt over packed (an ``array('I')``, as the frontend does since the prompt is
packed once per request, ``kv_hashing.packed_prompt``) instead of as a list: the digests must not change.

    PYTHONPATH=. python scripts/router_decision_digests.py --packed > packed.txt && diff old.txt packed.txt
"""

import hashlib
import random
import sys
from array import array

from components.protocol.kv_hashing import block_hashes
from components.protocol.messages import KvEvent, KvEventKind, LoadSnapshot
from components.router import Router, RouterConfig, RouteRequest

PACKED = "--packed" in sys.argv[1:]
POLICIES = ["round_robin", "random", "power_of_two", "least_loaded", "autellix", "kv", "kv+autellix", "kv_dynamo"]
CONFIGS = [
    {},
    {"router_temperature": 0.5},
    {"successor_weight": 0.0, "decode_weight": 0.0},
    {"balance_abs_threshold": 2, "balance_rel_threshold": 1.2},
    {"active_decode_blocks_threshold": 0.5, "active_prefill_tokens_threshold": 3000},
    {"successor_weight": 2.5, "decode_weight": 3.0, "locality_threshold_tokens": 256},
]


def run(seed, n_workers, policy, cfg, bs=16):
    rng = random.Random(seed)
    config = RouterConfig(router_policy=policy, router_seed=seed, **cfg)
    r = Router(config, rng=random.Random(seed))
    ids = sorted(rng.sample(range(1, 2**40), n_workers))
    step = {"prefill_ms_per_token": 0.015 * rng.uniform(0.5, 2)} if rng.random() < 0.5 else None
    meta = [
        (i, {"model": "m", "block_size": bs, **({"step_time": step} if step and rng.random() < 0.7 else {})})
        for i in ids
    ]
    r.set_workers("m", meta)
    vocab = 1000
    shared = [rng.randrange(vocab) for _ in range(bs * rng.randint(0, 40))]
    docs = [shared + [rng.randrange(vocab) for _ in range(bs * rng.randint(5, 200))] for _ in range(12)]
    eid = {i: 0 for i in ids}
    # cache some docs' prefixes on workers (prefix-closed chains), some with holes (non-prefix-closed)
    for d in docs:
        hs = block_hashes(d, bs)
        for w in rng.sample(ids, min(len(ids), rng.randint(1, 4))):
            k = rng.randint(1, len(hs))
            ev = KvEvent(eid[w], KvEventKind.BLOCK_STORED, hs[:k], None, bs)
            eid[w] += 1
            r.apply_kv_events(w, [ev])
            if rng.random() < 0.2 and k > 3:
                ev = KvEvent(eid[w], KvEventKind.BLOCK_REMOVED, [hs[1]])
                eid[w] += 1
                r.apply_kv_events(w, [ev])
    if shared and rng.random() < 0.7:
        sh = block_hashes(shared, bs)
        for w in ids:
            r.apply_kv_events(w, [KvEvent(eid[w], KvEventKind.BLOCK_STORED, sh, None, bs)])
            eid[w] += 1
    h = hashlib.sha256()
    inflight = []
    now = 100.0
    for i in range(300):
        now += rng.expovariate(50)
        if rng.random() < 0.3:
            w = rng.choice(ids)
            snap = LoadSnapshot(
                now_s=now,
                kv_usage=rng.random(),
                num_total_blocks=1000,
                num_active_blocks=rng.randrange(1000),
                num_running=rng.randrange(20),
                num_waiting=rng.randrange(5),
                num_waiting_prefill_tokens=rng.randrange(5000),
                num_preemptions=0,
                batch_size=1,
                num_kv_tokens=100,
            )
            r.apply_load(w, snap, now)
        d = rng.choice(docs)
        prompt = (
            d + [rng.randrange(vocab) for _ in range(rng.randint(1, 300))]
            if rng.random() < 0.8
            else [rng.randrange(vocab) for _ in range(rng.randint(1, 3000))]
        )
        pin = rng.choice(ids) if rng.random() < 0.05 else None
        excl = frozenset(rng.sample(ids, min(2, len(ids) - 1))) if rng.random() < 0.05 else frozenset()
        req = RouteRequest(
            array("I", prompt) if PACKED else prompt,
            "m",
            now,
            program_id=f"p{rng.randrange(20)}" if rng.random() < 0.6 else None,
            pinned_instance_id=pin,
            excluded_instance_ids=excl,
        )
        prep = r.prepare(req)
        dec = r.select(prep)
        h.update(repr((dec.instance_id, dec.overlap_blocks, str(dec.kind), dec.reason)).encode())
        rid = f"r{i}"
        r.on_routed(rid, dec, prep)
        inflight.append(rid)
        if rng.random() < 0.5 and inflight:
            r.on_first_token(rng.choice(inflight))
        if len(inflight) > 20 or rng.random() < 0.3:
            r.on_finished(inflight.pop(rng.randrange(len(inflight))))
        if dec.instance_id is not None and rng.random() < 0.3 and "kv" in policy:
            hs = block_hashes(prompt, bs)
            w = dec.instance_id
            r.apply_kv_events(w, [KvEvent(eid[w], KvEventKind.BLOCK_STORED, hs, None, bs)])
            eid[w] += 1
    return h.hexdigest()[:16]


out = []
for seed in range(5):
    for n in (1, 3, 8, 40, 300):
        for policy in POLICIES:
            for ci, cfg in enumerate(CONFIGS):
                if ci and seed % 2 and n > 40:
                    continue
                out.append(f"{seed} {n} {policy} {ci} {run(seed, n, policy, cfg)}")
print("\n".join(out))
