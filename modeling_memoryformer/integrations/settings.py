"""The options of `memoryformer push`: `PushSettings`, from whose fields the command line is made
(`cli.arguments`). A light module (standard library only), so that `--help` answers at once."""

from __future__ import annotations

from dataclasses import dataclass

from ..training.settings import option, required

DEFAULT_COMMIT_MESSAGE = "Upload MemoryFormer model and model card"


@dataclass
class PushSettings:
    """`memoryformer push`: a saved model, its tokenizer and a generated model card to the Hub. The token comes from
    HF_TOKEN or `hf auth login`, the Hub from HF_ENDPOINT."""

    model: str = required("folder written by save_pretrained: config.json and model.safetensors", metavar="DIR")
    repo_id: str = required("namespace/name on the Hub (a bare name goes to your account)")
    tokenizer: str | None = option(
        None, "tokenizer folder or Hub id (default: the tokenizer saved in --model, if there is one)", metavar="PATH")
    provenance: str | None = option(
        None, "how the weights were made: trained / converted from what, on what data (default: none)",
        metavar="TEXT")
    base_model: str | None = option(None, "Hub id of the model it was converted from (default: none)", metavar="ID")
    datasets: list[str] | None = option(
        None, "Hub id of a training dataset, repeatable (default: none)", flag="--dataset", action="append",
        metavar="ID")
    license: str = option("apache-2.0", "license of the model card")
    private: bool = option(False, "create the repo private (an existing repo is unchanged)")
    commit_message: str = option(DEFAULT_COMMIT_MESSAGE, "message of the Hub commit")
    preview_card: str | None = option(
        None, "write the model card to this file and stop: nothing is uploaded and the Hub is not contacted (an "
        "offline preview of what the push would write)", metavar="FILE")
    # repo_id: integrations.hub.check_repo_id; model: the folder is read by run_push
