"""Long Range Arena data: ListOps and Pathfinder generators, loaders of the release files of every task,
self-pretraining views (causal and masked) and their batches for the Trainer. See docs/lra.md."""

from .batches import LRABatches, inputs_targets, whole_split
from .dataset import LRADataset
from .image import load_image
from .listops import load_listops
from .listops_gen import (
    LISTOPS_SMOKE,
    ListOpsConfig,
    evaluate,
    generate_trees,
    to_source,
    tree_length,
    write_listops,
)
from .pathfinder import load_pathfinder
from .pathfinder_gen import DIFFICULTIES, PathfinderConfig, draw_pathfinder, pathfinder_config, write_pathfinder
from .png import decode_png, encode_png, read_png, write_png
from .spt import MASK_RATIOS, CausalLMView, MaskedLMView
from .tasks import TASKS, LRATask, get_task, list_lra_tasks, task_info
from .text import load_retrieval, load_text
from .vocab import BYTE_VOCAB, LISTOPS_VOCAB, MASK_ID, PAD_ID, PIXEL_VOCAB, UNK_ID, Vocab, collate

__all__ = [
    "LRABatches", "inputs_targets", "whole_split", "LISTOPS_SMOKE",
    "LRADataset", "load_image", "load_listops", "load_pathfinder", "load_retrieval", "load_text",
    "ListOpsConfig", "evaluate", "generate_trees", "to_source", "tree_length", "write_listops",
    "DIFFICULTIES", "PathfinderConfig", "draw_pathfinder", "pathfinder_config", "write_pathfinder",
    "decode_png", "encode_png", "read_png", "write_png",
    "MASK_RATIOS", "CausalLMView", "MaskedLMView",
    "TASKS", "LRATask", "get_task", "list_lra_tasks", "task_info",
    "BYTE_VOCAB", "LISTOPS_VOCAB", "PIXEL_VOCAB", "MASK_ID", "PAD_ID", "UNK_ID", "Vocab", "collate",
]
