"""Typed FastAPI dependencies: the service objects the app factory put on `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from proxy.adapters import AdapterManager
from proxy.chat import ChatService
from proxy.registry import ServedModels
from storage.store import Store


def get_chat(request: Request) -> ChatService:
    return request.app.state.chat


def get_registry(request: Request) -> ServedModels:
    return request.app.state.registry


def get_adapters(request: Request) -> AdapterManager:
    return request.app.state.adapters


def get_store(request: Request) -> Store:
    return request.app.state.store


Chat = Annotated[ChatService, Depends(get_chat)]
Registry = Annotated[ServedModels, Depends(get_registry)]
Adapters = Annotated[AdapterManager, Depends(get_adapters)]
StoreDep = Annotated[Store, Depends(get_store)]


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")
