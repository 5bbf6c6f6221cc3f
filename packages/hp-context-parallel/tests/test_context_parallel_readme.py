"""The README examples run as written."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README)
    assert "bytes received per rank:" in out


def test_readme_hugging_face_model_example_runs():
    out = run_markdown_example(README, index=1)
    assert "max |hidden| per rank:" in out


def test_readme_packed_documents_example_runs():
    out = run_markdown_example(README, index=2)
    assert "packed documents, max |out| per rank:" in out


def test_readme_grouped_query_attention_example_runs():
    out = run_markdown_example(README, index=3)
    assert "{'a2a:kv': 1024, 'a2a:q': 1024, 'a2a:o': 1024}" in out
