"""Workers of given engines, as the ingress learns them from etcd, and an intake that refuses
what they lack: the shared ground of the feature refusal tests (response_format, logprobs)."""

from __future__ import annotations

from schemas.messages import WorkerRegistration
from services.common.tokenizer import ByteTokenizer
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.intake import Intake
from services.ingress.settings import IngressApiSettings
from services.ingress.worker_features import WorkerFeatures
from tests.helpers import registration
from tests.ingress.helpers import MODEL


def worker(
    worker_id: str, engine: str, structured: bool, model: str = MODEL, logprobs: bool = False
) -> WorkerRegistration:
    return registration(worker_id).model_copy(
        update={
            "engine": engine,
            "model": model,
            "structured_outputs": structured,
            "logprobs": logprobs,
        }
    )


async def features_of(*workers: WorkerRegistration) -> WorkerFeatures:
    features = WorkerFeatures()
    await features.on_workers({w.worker_id: w for w in workers})
    return features


def intake(features: WorkerFeatures) -> Intake:
    settings = IngressApiSettings(instance_id="i", served_model_names=(MODEL, "other"))
    return Intake(ByteTokenizer(), settings, WorkerContextLimit(), features)
