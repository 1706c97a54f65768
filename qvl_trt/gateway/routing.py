"""Which build of a served model answers a chat request. A model has several builds where the
repository serves a checkpoint's builds of different workloads as one (a chat build at a high
batch beside a video or long-context build: triton/repository.py `_served_names`).

Before sending, the gateway knows the request's image and video parts and each build's
limits (its preprocessing model's parameters, mm.request.RequestLimits' names):
- a build admits the request only if it takes that many images and videos (max_videos 0:
  video off);
- a request with a video goes to the admitting build with the largest video budget: a clip
  is scaled down to a build's budget rather than refused, so only sending it there gives it
  the pixels a video build was made for;
- any other request goes to the admitting build that admits the most requests at once (its
  batch slots and queue places), the higher-batch chat build.
Only preprocessing knows the prompt's tokens (after the chat template, with the visual
tokens): a build that refuses the request above its engine limits (ErrorKind.ENGINE_LIMIT)
hands it, once and before anything went to the client, to the build whose limits are all at
least its own and one larger (the largest such): `larger`. A busy build (429) hands nothing
on: the larger build's few slots are the only place for the requests that need it, which
short chats spilling over would crowd out; the client's retry finds a slot in a moment.
"""

from __future__ import annotations

from .upstream import Build, ServedModel


def _admits(build: Build, images: int, videos: int) -> bool:
    return images <= build.limits.max_images and videos <= build.limits.max_videos


def _video_tokens(build: Build) -> int:
    """One video's visual tokens at most (max_video_tokens 0: the checkpoint's budget,
    within the request's)."""
    lim = build.limits
    return min(lim.max_video_tokens or lim.max_visual_tokens, lim.max_visual_tokens)


def _room(build: Build) -> tuple[int, ...]:
    """The limits a request's size meets only in preprocessing."""
    lim = build.limits
    return lim.max_input_len, lim.max_seq_len, lim.max_visual_tokens, _video_tokens(build)


def choose(model: ServedModel, images: int, videos: int) -> Build:
    """The build to send a request of `images` and `videos` to (see the module doc); where
    none admits the counts, the one that comes closest, whose refusal names its limit."""
    fits = [b for b in model.builds if _admits(b, images, videos)]
    if not fits:
        return max(model.builds, key=lambda b: (min(b.limits.max_videos, videos),
                                                min(b.limits.max_images, images), _room(b)))
    if videos:
        return max(fits, key=lambda b: (_video_tokens(b), b.capacity))
    # On a tie, the smaller build: the larger stays free for the requests that need it.
    return max(fits, key=lambda b: (b.capacity, [-x for x in _room(b)]))


def larger(model: ServedModel, refused: Build, images: int, videos: int) -> Build | None:
    """The build to send a request to that `refused` refused above its engine limits: of the
    admitting builds whose limits are all at least refused's and one larger, the largest;
    None where there is none."""
    floor = _room(refused)
    above = [b for b in model.builds if _admits(b, images, videos)
             and all(x >= y for x, y in zip(_room(b), floor, strict=True))
             and _room(b) != floor]
    return max(above, key=_room, default=None)
