"""InternVL2.5: the vision encoder (ViT + pixel shuffle + projector) and the LLM, composed."""

from __future__ import annotations

import torch
from torch import nn

from batchvl.config import InternVLConfig
from batchvl.encoder.internvit import VisionEncoder
from batchvl.llm.decoder import Decoder


class InternVL(nn.Module):
    def __init__(self, cfg: InternVLConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg)
        self.llm = Decoder(cfg.llm)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, S, S] -> [tiles * num_image_token, hidden]."""
        feats = self.vision(pixel_values.to(self.llm.embed_tokens.weight.dtype))
        return feats.reshape(-1, feats.shape[-1])

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, hidden] with image features written at <IMG_CONTEXT> positions."""
        h = self.llm.embed_tokens(input_ids)
        is_img = input_ids == self.cfg.image_token_id
        n = int(is_img.sum())
        if n or image_features is not None:
            have = 0 if image_features is None else image_features.shape[0]
            if have != n:
                raise ValueError(f"{n} <IMG_CONTEXT> tokens but {have} image feature rows")
            h = h.masked_scatter(is_img[:, None], image_features.to(h.dtype))
        return h
