"""Types and futures of the client API."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch
from transports import IN_PROCESS, service

import trio_widgets as trio


def test_tensor_data_round_trips():
    for value in ([1, 2, 3], np.array([1, 2, 3]), torch.tensor([1, 2, 3])):
        td = trio.TensorData.from_any(value)
        assert td.dtype == "int64" and td.tolist() == [1, 2, 3] and td.shape == [3]
    td = trio.TensorData.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert td.dtype == "float32" and td.to_numpy().shape == (2, 3)
    assert torch.equal(td.to_torch(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert trio.TensorData.from_torch(torch.tensor([0.5])).to_numpy().dtype == np.float32
    with pytest.raises(TypeError, match="unsupported numpy dtype"):
        trio.TensorData.from_numpy(np.array(["a"]))


def test_tensor_data_is_a_snapshot_whose_list_is_made_when_read():
    """TensorData keeps its values as an array until `data` is read (a served pool never reads
    them as Python numbers: issue 36's memory); it behaves as the list it was before."""
    import copy
    import pickle

    source = torch.tensor([[0.5, 1.5], [2.5, 3.5]])
    td = trio.TensorData.from_torch(source)
    source[0, 0] = 9.0  # a snapshot: the tensor it came from may change after
    view = td.to_numpy()
    view[0, 0] = 7.0  # a copy: changing it changes no TensorData
    assert "data" not in vars(td) and len(td) == 4  # nothing made yet
    assert td.to_numpy().tolist() == [[0.5, 1.5], [2.5, 3.5]] and td.tolist() == [[0.5, 1.5], [2.5, 3.5]]
    twin = pickle.loads(pickle.dumps(td))
    deep = copy.deepcopy(td)
    assert td.data == [0.5, 1.5, 2.5, 3.5] and "data" in vars(td)  # read: the list from now on
    td.data[3] = 4.5  # as a list: a change shows in everything after
    assert len(td) == 4 and td.to_numpy().tolist() == [[0.5, 1.5], [2.5, 4.5]]
    td.data = [1.0, 2.0, 3.0, 4.0]  # a list given replaces the values
    assert td.to_numpy().tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert twin == deep == trio.TensorData([0.5, 1.5, 2.5, 3.5], "float32", [2, 2]) != td
    assert repr(twin) == "TensorData(data=[0.5, 1.5, 2.5, 3.5], dtype='float32', shape=[2, 2])"
    with pytest.raises(AttributeError, match="no attribute 'values'"):
        twin.values  # noqa: B018


def test_datum_accepts_lists_numpy_and_torch():
    d = trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={
        "target_tokens": np.array([6, 7, 8]), "weights": torch.tensor([1.0, 0.5, 0.0]), "advantages": [1, 2, 3]})
    assert all(isinstance(v, trio.TensorData) for v in d.loss_fn_inputs.values())
    assert d.loss_fn_inputs["weights"].tolist() == [1.0, 0.5, 0.0]
    mi = trio.ModelInput(chunks=[trio.EncodedTextChunk([1, 2]), trio.EncodedTextChunk([3])])
    assert mi.to_ints() == [1, 2, 3] and mi.length == 3 and mi.append_int(4).to_ints() == [1, 2, 3, 4]


def test_future_api_from_threads_and_loops(svc):
    tc = svc.create_lora_training_client(trio.DEFAULT_MODEL, rank=2, seed=0)
    d = trio.Datum(model_input=trio.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
    seen = []
    fut = tc.forward([d])
    fut.add_done_callback(lambda f: seen.append(f.cycle))
    out = fut.result(timeout=60)
    assert fut.done() and fut.exception() is None and isinstance(out, trio.ForwardBackwardOutput)
    assert out.loss == out.metrics["loss:sum"] and len(out.loss_fn_outputs[0]["logprobs"]) == 3
    assert seen == [fut.cycle] and isinstance(fut.cycle, int)

    async def both_ways():
        f = await tc.forward_async([d])
        return (await f).loss, (await f.result_async(timeout=60)).loss

    a, b = asyncio.run(both_ways())
    assert a == b == out.loss  # the adapter did not change: forward has no side effects


def test_service_client_info_and_capabilities(pool, transport):
    if transport == IN_PROCESS:  # an API key given in-process is accepted, and not needed
        assert trio.ServiceClient(pool, api_key="ignored").get_server_capabilities().supported_models
    with service(transport, pool) as svc:
        _info_and_capabilities(svc)


def _info_and_capabilities(service: trio.ServiceClient) -> None:
    names = [m.model_name for m in service.get_server_capabilities().supported_models]
    assert trio.DEFAULT_MODEL in names
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=3, seed=4, train_mlp=False)
    info = tc.get_info()
    assert (info.model_data.base_model, info.model_data.lora_rank, info.model_data.seed,
            info.model_data.train_mlp) == (trio.DEFAULT_MODEL, 3, 4, False)
    tok = tc.get_tokenizer()
    assert tok.decode(tok.encode("12+3=15", add_special_tokens=False)) == "12+3=15"


# `make test` runs it alone: it reads the cycles per update a pipelined loop took (1.05 once, beside
# the other worker's tests: a missed boundary)
@pytest.mark.alone
def test_headless_demo_prints_pipelined_progress():
    out = subprocess.run([sys.executable, "-m", "trio_widgets", "demo", "--seconds", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert lines["cycles per update"].startswith("1.00")
    first, last = (float(x) for x in lines["loss per token"].split(" -> "))
    assert int(lines["updates"]) > 10 and last < first
