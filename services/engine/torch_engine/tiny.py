"""A tiny, seeded Llama checkpoint in Hugging Face layout, written on the fly.

Tests, demos and the GPU check need a real model directory (config, weights, tokenizer, chat
template) without downloading one. The weights are random, so the text it generates is noise,
but every code path of a real checkpoint is exercised and a seed fixes every byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.common.hf_tokenizer import CHATML_TEMPLATE

HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 688
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
# The trainer's target; it stops a few ids short (merges that recreate an existing token add
# none), and the model keeps the spare rows as padding, as real checkpoints pad theirs.
VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
INIT_STD = 0.02

BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Ids 0, 1, 2 in this order: the trainer places special tokens first.
SPECIAL_TOKENS = (BOS_TOKEN, IM_START, IM_END)
# A chat model ends its turn with <|im_end|>, so that is what generation stops on.
EOS_TOKEN = IM_END

# Original prose for the BPE trainer: enough distinct words to fill the vocabulary with merges
# that look like English, so that prompts tokenize to plausible lengths.
CORPUS = """\
The lane ran down from the old market to the river, and in the early morning it was full of carts,
barrows and people who had somewhere to be. Bakers carried trays of bread on their heads. A boy
with a bucket of fish shouted prices that nobody believed. The smell of coffee, tar and wet stone
hung over everything until the sun rose high enough to burn the mist off the water.

At the bottom of the lane stood the ferry house, a narrow building of grey brick with a bell on a
bracket by the door. The ferryman rang it twice when the boat was ready and once when it was full.
He had worked the crossing for thirty-one years, and he said he could tell the weather for the
whole week from the colour of the river at dawn: brown meant rain, green meant wind, and silver
meant a fine day that would end in fog.

Across the water the town was different. The streets were wider and straighter, the houses were
painted white or yellow, and there were gardens behind iron railings. A library with a copper dome
faced a square where children played around a fountain. The librarian, Mrs. Abernethy, kept the
doors open until nine in the evening because, she said, people who work all day deserve to read
at night. Her shelves held atlases, almanacs, histories of the county, books of verse, manuals for
engines and looms, and a great many novels that the town council did not approve of.

In winter the river sometimes froze at the edges. The ferry kept running through a channel that
the ferryman broke each morning with a long pole. Skaters came down on Sundays, and a man sold hot
chestnuts from a brazier at the top of the steps. The price was one penny for a paper cone, two
pence for a large one, and nothing at all if you were small and looked cold enough.

Spring arrived slowly, first as a change in the light and then all at once. The willows along the
bank turned a pale green, swallows returned to the eaves of the ferry house, and the market filled
with onions, radishes, early lettuce and bunches of daffodils. Farmers from the valley came in on
Thursdays with eggs, butter, cheese and honey. They talked about the price of seed, the state of
the roads and the new railway that was supposed to reach the town within five years, or ten, or
never, depending on whom you asked.

The railway did come, in the end. Engineers surveyed the hills, measured the valley and drew plans
for a bridge of nine arches. Hundreds of workers arrived with picks and shovels. They lived in
huts beside the line, ate in long wooden halls and spent their wages in the taverns on the lane.
The bridge took four summers to build. When the first train crossed it, the whole town turned out
to watch, and the band played until the musicians could no longer feel their lips.

After the railway, nothing was quite the same. Letters arrived in a day instead of a week. Fresh
fish came from the coast packed in ice. Young people left for the city, and some of them came back
with strange clothes and stranger ideas. The ferry still ran, because the bridge was two miles
upstream and most people did not want to walk that far for a loaf of bread or a pint of milk.

The ferryman's daughter, Elena, learned the crossing from her father. She could read the current
as well as he could, and better in the dark. When he retired she took over the boat, painted it
blue, and hung a lantern at the stern so that travellers could see her coming through the fog.
She kept a ledger of every crossing: the date, the hour, the number of passengers, the cargo and
the weather. The ledger ran to eleven volumes and is kept today in the library under the dome.

Reading it now, one learns small things that no history records. On the fourth of March the river
was high and the boat carried a piano. On a Tuesday in June a wedding party crossed singing, and
the bride lost a shoe in the water. On the longest night of the year Elena made twelve crossings,
because the bridge was closed by snow and the doctor had to reach a child with a fever. The child
lived, and grew up to be the town's first engineer to design an electric tram.

The tram line opened forty years later, running from the station to the market and down the lane
to the river. It was painted green and cream and rang a bell at every corner. Passengers paid a
fare of three pence, or one penny for children and the elderly. The old carts gave way to vans,
the cobbles were covered with asphalt, and the bakers stopped carrying bread on their heads.

Still, some things stayed. The market opened at six every morning except Sunday. The library kept
its late hours. The fountain in the square still ran, although the water now came from a pump
rather than a spring. And at the bottom of the lane the ferry house still stood, with its bell on
the bracket by the door, rung twice when the boat was ready and once when it was full.

Questions people asked at the ferry, as written in the ledger: How deep is the river here? About
twelve feet in summer and twenty in spring. Is the crossing safe in a storm? Safer than the bridge
in a gale, said Elena, because the boat bends and the bridge does not. How long does it take?
Seven minutes on a calm day, ten against the wind, and as long as it takes when there is fog.
Why not build a second bridge? Because then there would be nothing to talk about on the way over.

A short list of things found in the lost property cupboard of the ferry house: forty-two umbrellas,
a violin without strings, three pairs of spectacles, a stuffed owl, a bag of marbles, one glove,
a map of the world printed in 1851, a tin of peppermints, a book of poems with a pressed flower
inside, and a key that nobody ever claimed and nobody could match to any lock in the town.

Numbers from the ledger, for those who like them: 1,204 crossings in the first year; 9,876 in the
busiest year; 17 days with no crossing at all, all of them in floods; 3 boats built, 2 sunk at
their moorings, 1 still afloat. The fare rose from a halfpenny to a penny, then to two pence, and
finally the town decided that the ferry should be free, paid for by a small tax on the market.

Visitors today walk down the lane, look at the river and ask whether the story is true. The
librarian answers that every word of it is in the ledger, and that they are welcome to read it,
as long as they wash their hands first and do not lick their fingers to turn the pages.

Some visitors come from far away: a café owner from the coast, a naïve young poet with a notebook,
a retired sea captain who argues with the ferryman about knots and tides. They sit on the bench by
the ferry house, drink tea from tin mugs, and watch the light move on the water. Nobody is in a
hurry. The boat comes when it comes, and the bell rings twice when it is ready.

The weather station on the hill was built by the same engineer who designed the tram. It had a
wind vane shaped like a fish, a rain gauge, two thermometers in a white louvred box, and a clock
that nobody trusted. Every evening a volunteer climbed the path, wrote the readings in a notebook
and posted them on a board outside the post office. Fishermen, farmers and washerwomen consulted
the board before deciding anything important, and then mostly did what they had planned anyway.

Schoolchildren were taken to the station once a year. They learned that warm air rises, that
clouds are made of tiny droplets, and that a falling barometer means trouble. They measured the
shadow of a pole at noon and worked out, with some help, how far the town was from the equator.
Afterwards they were given apples and allowed to run down the hill, which was the part most of
them remembered for the rest of their lives.

Recipes were exchanged on the ferry as often as news. Elena's own was for a stew of beans, smoked
sausage, carrots, garlic and thyme, simmered for three hours in an iron pot and served with bread
that had to be torn, never cut. A baker from the lane swore that his rye loaf needed a spoonful of
treacle and a pinch of caraway; his rival insisted on honey and fennel. Their customers agreed
with whichever one they happened to be standing closest to at the time.

The river itself changed over the years. Floods moved sandbanks, a mill weir was removed, and
herons returned to the reeds below the bridge. Otters were seen again after half a century of
absence. A society was formed to count them; its members met in the library on the first Monday
of each month, argued about methods, and published a small annual report with drawings by a
retired schoolteacher who signed her work only with the initials M. G.

Music was everywhere in the town, though never grand. There was a brass band that practised in
the drill hall, a choir that sang in the chapel on the corner, a fiddler who played outside the
tavern for coins, and an organ grinder with a patient monkey that wore a red waistcoat. On summer
evenings the band gave concerts in the square, and couples danced on the flagstones while old men
complained that the tempo was too fast, too slow, or simply not what it used to be.

Trade followed the seasons. In autumn there were apples, pears, plums, walnuts and quinces, and the
cider press behind the market ran day and night. Wool came down from the hills in bales tied with
twine; leather came from the tannery by the marsh, which everyone could smell but nobody visited.
Merchants weighed, haggled, wrote receipts, shook hands, and occasionally shouted, although the
market warden, a tall quiet woman with a brass badge, could silence a quarrel simply by arriving.

Electricity reached the lane before it reached the farms. At first there were only a few bulbs in
the shop windows, which people came from miles away to admire. Then came street lamps, a cinema
with velvet seats, a wireless set in the tavern, and eventually a refrigerator in the butcher's,
which he showed to visitors as if it were a relic. The ferry, however, kept its oil lantern; Elena
said that electricity and water were best kept apart, and nobody could think of a good reply.

A few rules of the ferry, painted on a board beside the landing stage: Passengers must remain
seated while the boat is moving. Dogs are welcome, goats by arrangement. No more than twelve
persons, or eight persons and a cart. Do not feed the swans, which are rude. Lost property will be
kept for one year and then given to the library. The ferryman's decision on weather is final.

Questions and answers from the school examination of that year, preserved by accident between the
pages of the ledger: What is the capital of the county? The town with the cathedral. Name three
rivers. Ours, the big one, and the one on the map. Explain why the moon changes shape. Because the
sun shines on different parts of it as it travels round us. Describe your journey to school. I
take the ferry, and if it is foggy I am late, and the teacher knows why, so it does not matter.
"""


def make_tiny_model(directory: Path, seed: int = 0) -> None:
    """Write a Llama checkpoint of about four million parameters into ``directory``:
    ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.
    The same seed writes the same files."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", _tokenizer_config())
    bos_id = SPECIAL_TOKENS.index(BOS_TOKEN)
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    _write_json(directory / "config.json", _model_config(bos_id, eos_id))
    save_file(_weights(seed), str(directory / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer() -> Tokenizer:
    # Byte-level BPE as GPT-2 and Qwen use it: every byte string is encodable, so any prompt
    # round-trips, and no BOS is added because the chat template delimits turns itself.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHATML_TEMPLATE,
    }


def _model_config(bos_id: int, eos_id: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": bos_id,
        "initializer_range": INIT_STD,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _weights(seed: int) -> dict[str, torch.Tensor]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN_SIZE)}
    kv_width = NUM_KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (NUM_HEADS * HEAD_DIM, HIDDEN_SIZE),
            f"{layer}.self_attn.k_proj.weight": (kv_width, HIDDEN_SIZE),
            f"{layer}.self_attn.v_proj.weight": (kv_width, HIDDEN_SIZE),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN_SIZE, NUM_HEADS * HEAD_DIM),
            f"{layer}.mlp.gate_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{layer}.mlp.up_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{layer}.mlp.down_proj.weight": (HIDDEN_SIZE, INTERMEDIATE_SIZE),
            f"{layer}.input_layernorm.weight": (HIDDEN_SIZE,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN_SIZE,),
        }
    shapes["model.norm.weight"] = (HIDDEN_SIZE,)
    shapes["lm_head.weight"] = (VOCAB_SIZE, HIDDEN_SIZE)
    # One generator drawn in a fixed order: the same seed gives the same tensors on any machine.
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.normal(0.0, INIT_STD, shape, generator=generator)
    return weights


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
