"""Language modelling on real text: corpora of text files split by file, tokenizers (bytes, byte-level BPE),
memory-mapped token shards, next-token windows and bits per byte."""

from linattn.data.text.corpus import (
    SPLITS,
    MultiCorpus,
    TextCorpus,
    make_corpus,
    make_sources_corpus,
    split_of,
    stdlib_corpus,
    stdlib_docs_sources,
)
from linattn.data.text.score import bits_per_byte, mean_loss_to_bpb, unigram_entropy_bpb
from linattn.data.text.shards import TokenShards, build_shards
from linattn.data.text.tokenizer import BPETokenizer, ByteTokenizer, MissingDependencyError
from linattn.data.text.windows import EvalWindows, TokenWindows, eval_windows

__all__ = ["SPLITS", "MultiCorpus", "TextCorpus", "make_corpus", "make_sources_corpus", "split_of", "stdlib_corpus",
           "stdlib_docs_sources", "bits_per_byte", "mean_loss_to_bpb",
           "unigram_entropy_bpb", "TokenShards", "build_shards", "BPETokenizer", "ByteTokenizer",
           "MissingDependencyError", "EvalWindows", "TokenWindows", "eval_windows"]
