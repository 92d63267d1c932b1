"""The committed gRPC modules are what grpcio-tools makes of the .proto files, and the services carry the names the
kubelet calls."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("grpc_tools")

from gemini.k8s.proto import deviceplugin_v1beta1_pb2 as dp  # noqa: E402
from gemini.k8s.proto import podresources_v1_pb2 as pr  # noqa: E402


def test_generated_modules_are_current():
    proc = subprocess.run([sys.executable, "-m", "gemini.k8s.proto.generate", "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_service_and_method_names_are_the_kubelets():
    services = {s.full_name: [m.name for m in s.methods] for f in (dp, pr)
                for s in f.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
                                 "PreStartContainer"],
        "v1.PodResourcesLister": ["List", "Get"],
    }
    # field numbers are the wire format: the ones the API reference gives
    numbers = {f.name: f.number for f in dp.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert numbers == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    numbers = {f.name: f.number for f in dp.ContainerPreferredAllocationRequest.DESCRIPTOR.fields}
    assert numbers == {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    numbers = {f.name: f.number for f in pr.ContainerDevices.DESCRIPTOR.fields}
    assert numbers == {"resource_name": 1, "device_ids": 2}
