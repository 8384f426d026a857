"""What every route needs from the app: the Redis connection, the settings, the batch feeder."""

from typing import Annotated

import redis
from fastapi import Depends, Request

from jobs.batch_feed import BatchFeeder
from jobs.settings import Settings


def redis_conn(request: Request) -> redis.Redis:
    return request.app.state.conn


def settings(request: Request) -> Settings:
    return request.app.state.settings


def batch_feeder(request: Request) -> BatchFeeder:
    return request.app.state.feeder


Conn = Annotated[redis.Redis, Depends(redis_conn)]
Config = Annotated[Settings, Depends(settings)]
Feeder = Annotated[BatchFeeder, Depends(batch_feeder)]
