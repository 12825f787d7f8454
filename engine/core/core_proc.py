"""The engine core in a process of its own (issue 32; vLLM v1's EngineCore is the model).

`core_main` runs in a child process started with the *spawn* method (never fork: torch's thread
pools do not survive a fork). It owns one LLMEngine and runs the step loop busy while there is
work; between steps it drains the commands its client sent. Nothing the front end does (drawing,
HTTP, snapshots' decoding) runs in this interpreter, so it never competes for this GIL.

Transport: three ZMQ sockets over ipc:// in a private (0700) directory the client made; the
client binds them, the core connects.
- commands, client -> core (PUSH/PULL): pickled (call_id, op, args) tuples. Pickle because the
  payloads are the project's own config objects (EngineConfig, SamplingParams) between a parent
  and the child it spawned, on a socket only this user can open.
- outputs, core -> client (PUSH/PULL, no high-water mark: never dropped): multipart
  [kind, payload]. kind b"out": msgpack of {"step", "outs": [RequestOutput as dict], "fin":
  [finished-request records]}; b"reply": pickled (call_id, ok, value); b"ready", b"crash",
  b"bye": pickled.
- snapshots, core -> client (PUSH/PULL, high-water mark 1, sent without blocking): msgpack of
  {"snap": Snapshot.to_dict(), "dropped": frames dropped so far}. A client too slow to read
  them makes the core drop frames (counted), never wait.

The wire forms are the observe package's own: snapshot.plain (Snapshot.to_dict) / snapshot.from_plain
(the trusted inverse, no validation: a frame from this program's own child process).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
import traceback

import msgpack

SNAPSHOT_INTERVAL_S = 0.05  # the fastest a reader gets frames
SNAPSHOT_HEARTBEAT_S = 1.0  # a frame at least this often while the engine works, read or not
IDLE_POLL_MS = 200
PARENT_CHECK_S = 0.5
SNAPSHOT_SOCKET_BUFFER = 8192  # kernel buffer of the snapshot sockets: frames beyond it are dropped
FINISH_FIELDS = (
    "request_id",
    "finish_reason",
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "finish_time",
    "token_times",
    "num_output_tokens",
    "num_prompt_tokens",
    "origin",
    "tier",
)


# ------------------------------------------------------------------ wire forms (both sides)
def output_to_wire(out) -> dict:
    return dataclasses.asdict(out)


def output_from_wire(d: dict):
    from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

    return RequestOutput(
        request_id=d["request_id"],
        prompt=d["prompt"],
        prompt_token_ids=d["prompt_token_ids"],
        outputs=[CompletionOutput(**c) for c in d["outputs"]],
        finished=d["finished"],
        metrics=RequestMetrics(**d["metrics"]),
        error=d.get("error"),
    )


def finished_record(req) -> dict:
    """What a metrics listener reads of a finished request (engine/serve/metrics.py on_finish)."""
    rec = {}
    for f in FINISH_FIELDS:
        v = getattr(req, f, None)
        rec[f] = list(v) if isinstance(v, (list, tuple)) else v
    return rec


class FinishedRequest:
    """A finished request's record on the client side, with the attributes listeners read."""

    def __init__(self, rec: dict):
        for f in FINISH_FIELDS:
            setattr(self, f, rec.get(f))
        self.token_times = list(self.token_times or [])


ERRORS = {"ValueError": ValueError, "KeyError": KeyError, "TypeError": TypeError}


def remote_error(typ: str, msg: str, known: dict[str, type] = ERRORS) -> Exception:
    """The exception to raise here for one a child process sent as (type name, message): the
    same type where it is in `known`, else a RuntimeError naming the type."""
    return known[typ](msg) if typ in known else RuntimeError(f"{typ}: {msg}")


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ------------------------------------------------------------------ the core
class _Core:
    def __init__(self, engine, sockets, parent_pid: int, snapshot_interval: float):
        self.engine = engine
        self.cmd, self.out, self.pub = sockets
        self.parent_pid = parent_pid
        self.snapshot_interval = snapshot_interval
        self.stop = False
        self.crash_next = None  # a test hook: the next step raises this message
        self.pace_s = 0.0  # a pause after every step (tests: keep requests in flight)
        self.hold_until = 0.0  # no step before this monotonic time (op_hold)
        self.dropped = 0
        self.dropped_told = 0  # the count the last frame that got out carried
        self.wanted = True  # the client read the last frame: a new one may be published
        self.push = False  # publish every snapshot_interval whether read or not
        self.last_snap_t = 0.0
        self.last_snap_step = -1
        self.done_dicts: dict = {}  # finished requests' plain data, by (id, state, finish time)
        self.last_parent_check = time.monotonic()
        # what the clients ask of this core and what it costs (op_stats; KVSCOPE_CORE_STATS)
        self.stats = {"ops": {}, "steps": 0, "step_s": 0.0, "frames": 0, "frame_s": 0.0, "frame_bytes": 0}
        self.stats_path = os.environ.get("KVSCOPE_CORE_STATS") or None
        self.stats_written = 0.0
        # finished-request records for the client's metrics listeners
        engine.metrics.subscribe(self._on_finish)
        self.finished: list[dict] = []
        self.kv_pub = None  # vLLM's KV events publisher (engine serve --kv-events-endpoint), owned here

    def _on_finish(self, req) -> None:
        rec = finished_record(req)
        self.finished.append(rec)
        if self.stats_path:  # the core's own timing of its last requests, for a benchmark to compare
            tt = rec["token_times"] or []
            recent = self.stats.setdefault("recent", [])
            recent.append([rec["request_id"], rec["origin"], len(tt), tt[0] if tt else None, tt[-1] if tt else None])
            del recent[:-20]

    # -------------------------------------------------------------- commands
    def handle(self, cid, op, args):
        fn = getattr(self, "op_" + op, None)
        t0 = time.perf_counter()
        try:
            if fn is None:
                raise ValueError(f"unknown engine-core command {op!r}")
            value = fn(**args)
            self.reply(cid, True, value)
        except Exception as e:  # noqa: BLE001 - sent to the caller, the core keeps serving
            self.reply(cid, False, (type(e).__name__, str(e)))
        n, s = self.stats["ops"].get(op, (0, 0.0))
        self.stats["ops"][op] = (n + 1, s + time.perf_counter() - t0)

    def reply(self, cid, ok, value) -> None:
        if cid is None:
            return
        self.out.send_multipart([b"reply", pickle.dumps((cid, ok, value))])

    def op_submit(self, prompt, params, request_id, chat, origin):
        from engine.core.inputs import check_prompt_length

        eng = self.engine
        if chat:
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("prompt must be a non-empty string")
            check_prompt_length(prompt)
            prompt_in = eng.apply_chat_template(prompt)
        else:
            prompt_in = prompt
        if request_id in eng.requests:
            raise KeyError(request_id)  # the client picks another id (or refuses a caller's)
        eng.add_request(request_id, prompt_in, params, origin=origin, prompt_text=prompt if chat else None)
        return request_id

    def op_submit_many(self, items):
        """Several op_submit in one command, so one step admits them all (the API's batches):
        each one's (True, request id) or (False, (error type, message))."""
        out = []
        for item in items:
            try:
                out.append((True, self.op_submit(**item)))
            except Exception as e:  # noqa: BLE001 - handed to its own request
                out.append((False, (type(e).__name__, str(e))))
        return out

    def op_abort(self, request_id):
        eng = self.engine
        done = eng.abort_request(request_id)
        req = eng.get_request(request_id)
        out = output_to_wire(eng.request_output(req)) if req is not None else None
        self.publish(force=True)
        return done, out

    def op_evict(self, request_id):
        r = self.engine.evict(request_id)
        self.publish(force=True)
        return r

    def op_set_kv_budget(self, num_blocks):
        self.engine.set_num_blocks(num_blocks)
        self.publish(force=True)

    def op_snapshot(self):
        return self.snapshot_dict()

    def op_preview(self, user, params, system):
        from engine.core.preview import preview, template_ids

        ids, content = template_ids(self.engine.tokenizer, user, system) if user.strip() else ([], 0)
        return preview(self.engine, ids, content, params)

    def op_events_since(self, seq, kinds):
        return [e.to_dict() for e in self.engine.events.since(seq, kinds)], self.engine.events.last_seq

    def op_events_info(self):
        ev = self.engine.events
        return ev.last_seq, len(ev), ev.maxlen

    def op_call(self, name, args):
        """A read-only engine method the client's EngineView forwards (max_completion_tokens, ...)."""
        if name not in (
            "max_completion_tokens",
            "has_unfinished_requests",
            "decode",
            "apply_chat_template",
            "info",
            "admission_check",
        ):
            raise ValueError(f"engine method {name!r} is not offered across the process boundary")
        return getattr(self.engine, name)(*args)

    # -------------------------------------------------------------- the block pool (fleet routes)
    def op_pool_info(self):
        """What /get_server_info reports of the block pool (the client's PoolView)."""
        bm = self.engine.bm
        return {
            "block_size": bm.block_size,
            "enable_prefix_caching": bool(bm.enable_prefix_caching),
            "hash_algo": bm.hasher.algo,
            "hash_seed": bm.hasher.seed,
        }

    def op_cached_hashes(self):
        return self.engine.bm.cached_hashes()

    def op_reset_prefix_cache(self):
        r = self.engine.bm.reset_prefix_cache()
        self.publish(force=True)
        return r

    # -------------------------------------------------------------- KV events (vLLM's wire)
    def op_kv_events_open(self, endpoint, replay_endpoint=None, wire="current", first_seq=0, cleared=False):
        """Publish this engine's KV events on `endpoint` (a ValueError naming it when it cannot
        be opened); returns the publisher's info. first_seq / cleared: it continues a publisher
        an earlier core closed (EngineClient.reconfigure)."""
        from engine.observe.kv_events import open_publisher

        self.op_kv_events_close()
        pub = open_publisher(endpoint, replay_endpoint, wire, first_seq=first_seq)
        try:
            pub.attach(self.engine, cleared=cleared)
        except BaseException:
            pub.close()
            raise
        self.kv_pub = pub
        return dataclasses.asdict(pub.info())

    def op_kv_events_info(self):
        return dataclasses.asdict(self.kv_pub.info()) if self.kv_pub is not None else None

    def op_kv_events_close(self):
        """Send what is pending, close the sockets; returns the next seq number (None: none open)."""
        pub, self.kv_pub = self.kv_pub, None
        if pub is None:
            return None
        pub.close()
        return pub.next_seq

    def op_attr(self, name):
        """A plain engine attribute the client's EngineView reads (vocab_size, cpu_threads)."""
        if name not in ("vocab_size", "cpu_threads", "step_num"):
            raise ValueError(f"engine attribute {name!r} is not offered across the process boundary")
        return getattr(self.engine, name)

    def op_check_invariants(self):
        self.engine.check_invariants()
        return True

    def op_stats(self):
        """What this core's clients asked of it and what it cost: per command name (count,
        seconds handling it), steps and their seconds, snapshot frames built, their seconds and
        bytes."""
        return {**self.stats, "ops": dict(self.stats["ops"])}

    def write_stats(self) -> None:
        """KVSCOPE_CORE_STATS=path: op_stats as JSON, rewritten about once a second while the core
        works (a benchmark reads what the pages asked of the core)."""
        import json

        self.stats_written = time.perf_counter()
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.op_stats(), f)
        os.replace(tmp, self.stats_path)

    def op_crash_next_step(self, message):
        self.crash_next = message
        return True

    def op_want_snapshot(self):
        """The client read the last frame: the next step's state may be published. Frames are
        built only for a client that reads them, so an unwatched core spends nothing on them."""
        self.wanted = True

    def op_placement(self):
        """Where this core runs, read from the OS now (pid, CPUs, OS threads, torch threads)."""
        from engine.core.placement import describe

        return describe()

    def op_hold(self, seconds):
        """Take no step for up to `seconds` (0 resumes): a timing elsewhere on these CPUs (the
        Claims page's live measurement) is not shared with this core's forward passes. Bounded,
        so a measurer that died never stops the core for long."""
        self.hold_until = time.monotonic() + max(0.0, min(float(seconds), 300.0))
        return True

    def op_pace(self, seconds):
        self.pace_s = max(0.0, min(float(seconds), 1.0))
        return True

    def op_abort_all(self):
        eng = self.engine
        n = sum(1 for rid in list(eng.requests) if eng.abort_request(rid))
        self.publish(force=True)
        return n

    def op_shutdown(self):
        n = self.op_abort_all()
        self.engine.check_invariants()
        self.op_kv_events_close()
        self.stop = True
        return n

    # -------------------------------------------------------------- loop
    def publish(self, force: bool = False) -> None:
        import zmq

        now = time.perf_counter()
        step = self.engine.step_num
        wait = self.snapshot_interval if self.wanted or self.push else SNAPSHOT_HEARTBEAT_S
        due = now - self.last_snap_t >= wait and step != self.last_snap_step
        if force or due:
            self.wanted = False
            frame = pack({"snap": self.snapshot_dict(), "dropped": self.dropped})
            st = self.stats
            st["frames"] += 1
            st["frame_s"] += time.perf_counter() - now
            st["frame_bytes"] += len(frame)
            try:
                self.pub.send(frame, zmq.NOBLOCK)
                self.dropped_told = self.dropped
            except zmq.Again:
                self.dropped += 1
            self.last_snap_t, self.last_snap_step = now, step

    def snapshot_dict(self) -> dict:
        """The engine's snapshot as plain data for a frame. A finished request's part never
        changes, so it is converted once and kept (while the engine still lists it)."""
        from engine.observe.snapshot import plain

        snap = self.engine.snapshot()
        done, reqs = {}, []
        for r in snap.requests:
            if r.is_terminal:
                key = (r.request_id, r.state, r.finish_time)
                d = self.done_dicts.get(key)
                if d is None:
                    d = plain(r)
                done[key] = d
            else:
                d = plain(r)
            reqs.append(d)
        self.done_dicts = done
        d = plain(dataclasses.replace(snap, requests=()))
        d["requests"] = tuple(reqs)
        return d

    def drain(self, timeout_ms: int) -> None:
        if not self.cmd.poll(timeout_ms):
            return
        import zmq

        while not self.stop:
            try:
                raw = self.cmd.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            cid, op, args = pickle.loads(raw)
            self.handle(cid, op, args)

    def parent_gone(self) -> bool:
        now = time.monotonic()
        if now - self.last_parent_check < PARENT_CHECK_S:
            return False
        self.last_parent_check = now
        return os.getppid() != self.parent_pid

    def run(self) -> None:
        eng = self.engine
        while not self.stop:
            busy = eng.has_unfinished_requests()
            self.drain(0 if busy else IDLE_POLL_MS)
            if self.stop:
                break
            if self.parent_gone():  # the client's process died: abort its requests, leak nothing
                self.op_abort_all()
                eng.check_invariants()
                report = os.environ.get("KVSCOPE_CORE_EXIT_REPORT")
                if report:
                    with open(report, "w") as f:
                        f.write(f"aborted-and-invariants-ok blocks_used={eng.snapshot().metrics.num_blocks_used}\n")
                return
            if not eng.has_unfinished_requests():
                # idle: one frame of the final state, again until one gets out (so the client
                # sees the last state and the dropped count)
                self.publish(force=self.last_snap_step != eng.step_num or self.dropped_told != self.dropped)
                if self.stats_path and time.perf_counter() - self.stats_written >= 1.0:
                    self.write_stats()
                continue
            if self.hold_until and time.monotonic() < self.hold_until:
                self.drain(20)  # held: commands still answered
                continue
            if self.crash_next is not None:
                msg, self.crash_next = self.crash_next, None
                raise RuntimeError(msg)
            t0 = time.perf_counter()
            outs = eng.step()
            self.stats["steps"] += 1
            self.stats["step_s"] += time.perf_counter() - t0
            fin, self.finished = self.finished, []
            if self.kv_pub is not None:  # this step's KV events, in step order, as EngineThread's publisher
                self.kv_pub.collect(eng)
            self.out.send_multipart(
                [b"out", pack({"step": eng.step_num, "outs": [output_to_wire(o) for o in outs], "fin": fin})]
            )
            self.publish()
            if self.stats_path and t0 - self.stats_written >= 1.0:
                self.write_stats()
            if self.pace_s:
                time.sleep(self.pace_s)


def _place(cpus) -> None:
    from engine.core.placement import pin, prioritize

    prioritize()  # before any thread starts: they inherit it
    pin(cpus)  # where the OS allows (a container may refuse): the thread count still applies


def core_main(
    config_blob: bytes,
    addrs: tuple[str, str, str],
    parent_pid: int,
    snapshot_interval: float,
    cpus,
    push_snapshots: bool = False,
    kv_events: dict | None = None,
) -> None:
    """The child process's entry point: build the engine, say ready (or why not), run the loop.
    A crash is sent to the client with its reason before the process exits. kv_events (the
    arguments of op_kv_events_open): this core publishes vLLM's KV events from the start; a
    publisher that cannot open fails the start as a bad config does."""
    import signal

    import zmq

    # Ctrl-C in a terminal reaches the whole process group: the client shuts this core down
    # in order (and a core whose client died notices: parent_gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _place(cpus)
    ctx = zmq.Context()
    cmd = ctx.socket(zmq.PULL)
    cmd.connect(addrs[0])
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # outputs and replies are never dropped
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(addrs[1])
    pub = ctx.socket(zmq.PUSH)
    pub.setsockopt(zmq.SNDHWM, 1)
    pub.setsockopt(zmq.SNDBUF, SNAPSHOT_SOCKET_BUFFER)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(addrs[2])
    try:
        from engine.core.engine import LLMEngine

        config = pickle.loads(config_blob)
        engine = LLMEngine(config)
        core = _Core(engine, (cmd, out, pub), parent_pid, snapshot_interval)
        if kv_events:
            core.op_kv_events_open(**kv_events)
    except Exception as e:  # noqa: BLE001 - the client raises it where the caller asked for the engine
        out.send_multipart([b"build_failed", pickle.dumps((type(e).__name__, str(e)[:2000]))])
        out.close()
        ctx.term()
        return
    if engine.cpu_threads:
        import torch

        torch.set_num_threads(engine.cpu_threads)  # as the first step would: read back below
    from engine.core.placement import describe

    placement = describe()
    out.send_multipart([b"ready", pickle.dumps((placement, engine.config))])  # the config as resolved (max_model_len)
    core.push = push_snapshots
    core.publish(force=True)
    code = 0
    try:
        core.run()
        out.send_multipart([b"bye", pickle.dumps(None)])
    except Exception as e:  # noqa: BLE001 - the loop died: tell the client why, then exit
        msg = f"engine loop crashed: {type(e).__name__}: {str(e)[:500]}"
        traceback.print_exc()
        out.send_multipart([b"crash", pickle.dumps(msg)])
        code = 1
    if core.kv_pub is not None:  # what is pending still goes out (a crash, a client that died)
        core.op_kv_events_close()
    out.close()
    pub.close()
    cmd.close(linger=0)
    ctx.term()
    os._exit(code)
