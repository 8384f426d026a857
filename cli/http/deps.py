"""What every route needs from the app: the Redis connection and the settings."""

from typing import Annotated

import redis
from fastapi import Depends, Request

from jobs.settings import Settings


def redis_conn(request: Request) -> redis.Redis:
    return request.app.state.conn


def settings(request: Request) -> Settings:
    return request.app.state.settings


Conn = Annotated[redis.Redis, Depends(redis_conn)]
Config = Annotated[Settings, Depends(settings)]
