"""`--codec auto`: the codec follows the measured uplink speed."""

from __future__ import annotations

import pytest

from murmura.client import ClientRuntime, GrpcTransport, TorchTrainer
from murmura.client.rules import auto_codec
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, build_core
from murmura.tasks import TaskConfig, load_task


def test_auto_codec_picks_the_most_faithful_codec_that_fits_the_link() -> None:
    mb = 1_000_000
    assert auto_codec(4 * mb, 100 * mb, train_s=2.0) == ("dense-f32", {})    # 0.04 s
    assert auto_codec(4 * mb, 10 * mb, train_s=2.0) == ("int8", {})          # 0.4 -> 0.1 s
    assert auto_codec(4 * mb, 1 * mb, train_s=2.0) == ("topk", {"ratio": "0.01"})
    assert auto_codec(4 * mb, 0.01 * mb, train_s=2.0)[0] == "topk"           # nothing fits
    assert auto_codec(4 * mb, 10 * mb, train_s=60.0) == ("dense-f32", {})    # long training
    with pytest.raises(ValueError, match="link speed"):
        auto_codec(4 * mb, 0.0, train_s=1.0)


class _SlowLink(GrpcTransport):
    """Loopback gRPC whose pushes take 100 s on the runtime's (fake) clock: a slow uplink."""

    def __init__(self, address: str, clock: list[float]) -> None:
        super().__init__(address, timeout_s=10)
        self.clock = clock
        self.codecs: list[str] = []

    def push(self, header, payload):  # noqa: ANN001, ANN201
        self.codecs.append(header.codec)
        self.clock[0] += 100.0
        return super().push(header, payload)


@pytest.mark.integration
def test_a_slow_uplink_switches_the_client_to_a_smaller_codec(serve) -> None:
    task_cfg = TaskConfig(task="digits", model="logreg", partition="iid")
    cfg = ServerConfig.from_flat(mode="async", buffer_size=1, max_versions=3, min_clients=1,
                                 workers=0, train=TaskSettings(local_steps=2, batch_size=16))
    srv = serve(build_core(cfg, task_cfg, out_dir=None, evaluate=False))
    task = load_task(task_cfg)
    now = [0.0]
    link = _SlowLink(srv.address, now)
    try:
        rt = ClientRuntime(link, TorchTrainer(task.build_model(seed=0), task.client_data(0, 2),
                                              device="cpu"),
                           codec="auto", clock=lambda: now[0])  # an ephemeral signed identity
        stats = rt.run()
    finally:
        link.close()
    assert link.codecs[0] == "dense-f32" and set(link.codecs[1:]) == {"topk"}
    assert stats.pushed == 3 and srv.call(lambda: srv.core.version) == 3
