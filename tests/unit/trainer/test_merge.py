from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from script_modules import load_script
from transformers import AutoModelForCausalLM


@pytest.fixture
def adapter(tmp_path, tiny_model_path) -> Path:
    """A peft adapter on the tiny model whose B matrices are not zero, so it changes the logits."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_merged_model_reproduces_the_adapter_applied_logits(tmp_path, tiny_model_path, adapter):
    out = tmp_path / "merged"
    argv = ["--base-model", tiny_model_path, "--adapter-path", str(adapter), "--output-dir", str(out)]
    assert load_script("merge_lora").main(argv) == 0
    ids = torch.arange(3, 40)[None]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, adapter)(ids).logits
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)(ids).logits
        assert (plain - expected).abs().max() > 1e-3
    assert (out / "tokenizer.json").exists() and not any(out.glob("adapter_*"))


def test_push_uploads_the_merged_folder_with_its_model_card(tmp_path, tiny_model_path, adapter, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create_repo", repo_id, private))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    card = tmp_path / "card.md"
    card.write_text("# my model\n")
    args = ["--base-model", tiny_model_path, "--adapter-path", str(adapter), "--output-dir", str(tmp_path / "m"),
            "--push", "--repo-name", "me/model", "--private", "--model-card", str(card)]  # fmt: skip
    assert load_script("merge_lora").main(args) == 0
    assert calls[0] == ("create_repo", "me/model", True)
    assert calls[1][:2] == ("upload_folder", "me/model") and {"README.md", "model.safetensors"} <= set(calls[1][2])
    assert (tmp_path / "m" / "README.md").read_text() == "# my model\n"


def test_bad_arguments_are_one_line_errors(tmp_path, tiny_model_path, capsys):
    script = load_script("merge_lora")
    assert script.main(["--base-model", tiny_model_path, "--adapter-path", str(tmp_path), "--output-dir", "x"]) == 2
    assert f"error: --adapter-path {tmp_path}: no adapter_config.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--base-model", "m", "--adapter-path", "a", "--output-dir", "o", "--push"])
    assert exit_info.value.code == 2 and "--push needs --repo-name" in capsys.readouterr().err
