"""Worker role, one per tensor-parallel rank: `python -m pagedserve.workers.process --rank R ...`.

Sockets only: a DEALER to the scheduler's worker ROUTER and a PUSH to the launcher. It builds
the rank (`build_core`: the torch.distributed group, the model shard, the KV cache), reports
WorkerReady with the block counts this rank can hold, then hands every message to
WorkerService (workers/service.py); rank 0 replies with each step's StepResult.
"""
from __future__ import annotations

import os

import zmq

from pagedserve import cluster_auth, transport
from pagedserve.lifecycle import start_role
from pagedserve.pipeline import messages
from pagedserve.workers.build import build_core
from pagedserve.workers.heap import IdleTrim
from pagedserve.workers.service import WorkerService, WorkerStopped

def main() -> int:
    role = start_role("worker", "pagedserve worker")
    cfg, rank, log = role.config, role.rank, role.log
    ctx = zmq.Context()
    sched = transport.make_socket(ctx, zmq.DEALER, cfg.ipc.plan_addr, bind=False,
                                  identity=f"worker{rank}".encode(),
                                  secure=cluster_auth.for_address(
                                      cfg.ipc.plan_addr, cfg.cluster.cluster_secret_file,
                                      server=False))
    control = transport.make_socket(ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)
    service = None
    try:
        core, num_blocks, num_cpu_blocks = build_core(cfg, rank)
        service = WorkerService(core, rank, os.getpid(), num_blocks, num_cpu_blocks,
                                lambda msg: transport.send(sched, msg), role.faults)
        dispatcher = transport.Dispatcher(role.name, service.handlers(), log=log,
                                          report=lambda tag, why: transport.send(
                                              sched, messages.UnknownMessage(role.name, tag, why)))
        # Unsolicited: the scheduler answers with Reset(token) to make us part of its epoch.
        transport.send(sched, service.ready())
        transport.send(control, messages.ProcessReady("worker", rank, os.getpid(),
                                                      f"{num_blocks} KV blocks"))
        log.info("ready: %d device blocks, %d host blocks", num_blocks, num_cpu_blocks)
        role.faults.started()
        trim = IdleTrim()       # an idle worker hands a large step's activations back
        while True:
            if not sched.poll(trim.after_ms):
                trim.idle()
                continue
            dispatcher.receive(sched.recv_multipart())
            trim.busy()
    except WorkerStopped as stop:
        log.info("stop (%s)", stop)
        return 0
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        step_id = service.step_id if service is not None else -1
        log.exception("fatal at step %d: %s", step_id, exc)
        text = f"{type(exc).__name__}: {exc}"
        for sock, msg in ((sched, messages.WorkerFailed(rank, step_id, text)),
                          (control, messages.ProcessFatal("worker", rank, os.getpid(), text))):
            try:
                transport.send(sock, msg, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return 1
    finally:
        from pagedserve.workers.distributed import destroy_distributed
        destroy_distributed()
        sched.close(linger=500)
        control.close(linger=500)
        ctx.term()


if __name__ == "__main__":
    from pagedserve.lifecycle import exit_role
    exit_role(main())
