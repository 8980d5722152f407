"""The session file holds the resume token, which proves ownership of the server's session: owner-only (0600)
from its first byte, whatever the umask and whatever a killed client left behind. A record reads back as it was
written, and one written for another model is refused."""

import os
import stat
from pathlib import Path

import pytest

from tether.client.session import ClientConfig, EdgeSession
from tether.client.session_file import SessionRecord, load_record, save_record
from tether.client.transport import ServerError
from tether.v1 import tether_pb2 as pb


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_session_file_and_its_tmp_are_owner_only(tmp_path, monkeypatch):
    path = tmp_path / "session.json"
    stale = tmp_path / "session.json.tmp"
    stale.write_text("left by a killed client")
    stale.chmod(0o644)
    seen = []
    real_replace = Path.replace

    def replace(self, target):
        seen.append((self.read_text(), mode(self)))  # the tmp file, complete, just before it takes the name
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    session = EdgeSession(ClientConfig(session_file=str(path)))
    previous = os.umask(0)  # the mode must not depend on the umask
    try:
        session.link.info = pb.ModelInfo(model_fingerprint="f" * 64)
        session.text.restore([1, 2], [3], ["verified"])
        session.text.adopt(2)
        session.link.hold("s" * 32, "secret-token")
        session._save()
    finally:
        os.umask(previous)
        session.close()
    assert mode(path) == 0o600 and "secret-token" in path.read_text()
    assert seen and all(m == 0o600 for _, m in seen)


def test_a_record_reads_back_and_one_for_another_model_is_refused(tmp_path):
    path = tmp_path / "session.json"
    assert load_record(path, "f" * 64) is None
    record = SessionRecord("h:1,h:2", "f" * 64, "s" * 32, "t" * 32, [1, 2], [3, 4], ["verified", "offline"], 3, False)
    save_record(path, record)
    assert load_record(path, "f" * 64) == record
    with pytest.raises(ServerError) as refused:
        load_record(path, "e" * 64)
    assert refused.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 5])
def test_the_drafter_samples_from_a_stream_of_its_own(seed):
    """The server draws its verifier's uniforms from torch.Generator().manual_seed(session seed): a torch drafter
    seeded the same way would draft from those very numbers, and rejection sampling would no longer be lossless."""
    import torch

    from tether.client.seeds import draft_seed

    server = torch.rand(16, generator=torch.Generator().manual_seed(seed % 2**63))
    drafter = torch.rand(16, generator=torch.Generator().manual_seed(draft_seed(seed)))
    assert 0 <= draft_seed(seed) < 2**63 and not torch.equal(server, drafter)
