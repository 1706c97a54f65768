"""Two builds of one checkpoint behind one OpenAI model: `qvl-trt repo` names them one model
(triton/repository.py `_served_names`)."""

from __future__ import annotations

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.triton import contract as c

# ---- which builds the repository serves as one model ------------------------------------------

def test_the_repository_names_one_model_per_checkpoint_of_several_workloads(tmp_path) -> None:
    from qvl_trt.manifest import BuildFolder, Manifest
    from qvl_trt.triton.repository import _Build, _served_names

    def made(name: str, hashes: dict, workload: str | None = None,
             folder: str = "Qwen3-VL-2B-Instruct") -> _Build:
        options = {"model": folder} | ({"workload": workload} if workload else {})
        checkpoint = type("Checkpoint", (), {"path": tmp_path / folder})()
        return _Build(BuildFolder(tmp_path / name), Manifest(options=options,
                                                             inputs={"checkpoint": hashes}),
                      checkpoint, None, None)

    a, b = {"model.safetensors": "aa"}, {"model.safetensors": "bb"}

    def served(*builds: _Build) -> list[str]:
        names = [c.ModelNames.for_build(f"b{i}") for i in range(len(builds))]
        return _served_names(builds, names)

    assert served(made("chat", a), made("video", a, "video")) == ["Qwen3-VL-2B-Instruct"] * 2
    # Another checkpoint (other hashes, whatever its folder's name) is never in the group.
    assert served(made("chat", a), made("video", a, "video"),
                  made("other", b, "video", folder="Qwen3-VL-2B-Instruct-2")) == \
        ["Qwen3-VL-2B-Instruct", "Qwen3-VL-2B-Instruct", ""]
    # One checkpoint's builds of one workload (FP16 beside INT8, say) are served apart.
    assert served(made("fp16", a), made("int8", a)) == ["", ""]
    with pytest.raises(ConfigError, match="b0 and b2 are both chat builds of "
                       "Qwen3-VL-2B-Instruct.*leave one out"):
        served(made("chat", a), made("video", a, "video"), made("int8", a))
    with pytest.raises(ConfigError, match="served as the model 'Qwen3-VL-2B-Instruct', the "
                       "name of another build or checkpoint too"):
        served(made("chat", a), made("video", a, "video"), made("chat2", b),
               made("long", b, "long"))
