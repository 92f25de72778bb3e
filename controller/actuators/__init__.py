"""Actuators: how the controller starts, stops and labels replicas (one small interface)."""

from floodgate.controller.actuators.base import Actuator, ReplicaHandle, Role

__all__ = ["Actuator", "ReplicaHandle", "Role"]
