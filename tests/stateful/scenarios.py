"""The configurations the stateful suite runs, one test each so xdist spreads them."""

from kvoffload.spec import Config
from kvoffload.spec.groups import Group
from kvoffload.spec.kit import Scenario

SCENARIOS = {
    "k1-immediate-ample": Scenario(Config(num_gpu_blocks=16, tier_blocks=64)),
    "k1-immediate-tiny-tier": Scenario(Config(num_gpu_blocks=12, tier_blocks=1)),
    "k2-immediate-failures": Scenario(Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=6), failures=True),
    "k1-delayed-failures-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=12, tier_blocks=4, prefix_caching=False), delay=2, failures=True),
    "k2-delayed": Scenario(Config(num_gpu_blocks=14, offload_block_size=4, tier_blocks=4), delay=3),
    "k3-delayed-failures-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=18, offload_block_size=6, tier_blocks=3, prefix_caching=False), delay=1, failures=True),
    # admission: a block stored once offered twice (offers of the last 6 keys remembered); prompt blocks only
    "k1-threshold2-delayed-failures-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=12, tier_blocks=4, prefix_caching=False, store_threshold=2, offers_remembered=6),
        delay=2, failures=True),
    "k2-prompts-only-threshold3-delayed": Scenario(
        Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=6, store_threshold=3, store_prompts_only=True),
        delay=1),
}

# The modes vLLM runs on GPUs: async scheduling, speculative decoding, tensor-parallel workers, vLLM's default load
# failure policy ("fail"), and a persistent load fault (liveness); weight updates
# (reset_prefix_cache(reset_connector=True)) run in every scenario.
GPU_MODE_SCENARIOS = {
    "k1-async-delayed-failures-fail-policy-no-prefix-cache": Scenario(  # a failed load ends its request
        Config(num_gpu_blocks=14, tier_blocks=8, async_scheduling=True, prefix_caching=False,
               load_failure_policy="fail"), delay=2, failures=True),
    "k2-spec3-immediate-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=6, num_spec_tokens=3, prefix_caching=False)),
    "k1-async-spec2-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=4, async_scheduling=True, num_spec_tokens=2), delay=1, failures=True),
    "k1-tp2-delayed-failures-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=12, tier_blocks=4, num_workers=2, prefix_caching=False), delay=2, failures=True),
    "k2-tp4-async-spec3-delayed-failures": Scenario(
        Config(num_gpu_blocks=18, offload_block_size=4, tier_blocks=5, num_workers=4, async_scheduling=True,
               num_spec_tokens=3), delay=1, failures=True),
    "k1-broken-loads-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=6, prefix_caching=False), delay=1, failures=True, broken_loads=True),
    "k1-async-spec2-prompts-only-threshold2-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=4, async_scheduling=True, num_spec_tokens=2, store_threshold=2,
               store_prompts_only=True), delay=1, failures=True),
}

# Synchronous loads (every connector's, when the config asks): a hit loads in the step that computes the rest, under
# vLLM's "fail" policy, without async scheduling (LOOKUP says why).
SYNC_SCENARIOS = {
    "k1-sync-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=8, load_failure_policy="fail", sync_loads=True), delay=2,
        failures=True),
    "k2-sync-spec2-tp2-broken-loads": Scenario(  # every load fails on worker 1: every hit's request fails
        Config(num_gpu_blocks=18, offload_block_size=4, tier_blocks=6, num_workers=2, num_spec_tokens=2,
               load_failure_policy="fail", sync_loads=True), delay=1, failures=True, broken_loads=True),
    "k1-sync-immediate-failures-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=14, tier_blocks=8, prefix_caching=False, load_failure_policy="fail", sync_loads=True),
        failures=True),
}

ARC_SCENARIOS = {
    "arc-k1-immediate": Scenario(Config(num_gpu_blocks=14, tier_blocks=4, policy="arc", prefix_caching=False)),
    "arc-k2-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=5, policy="arc"), delay=2, failures=True),
    "arc-k1-delayed-tiny-tier": Scenario(
        Config(num_gpu_blocks=12, tier_blocks=2, policy="arc", prefix_caching=False), delay=1),
}

# Hybrid models: KV cache groups of full attention and sliding windows (windows in tokens; block_size 2, or a
# group's own: vLLM enlarges the blocks of layers with fewer bytes per token, so that every page has one size). A
# connector that declares GROUPS gets a block table per group; the others run with the hybrid manager off. A model
# whose layers all slide (Mistral-style) keeps its one windowed group for every connector, as in vLLM. The prefix
# cache keeps window and state blocks only where a later request resumes (vLLM's default retention) unless named.
HYBRID_SCENARIOS = {
    "hybrid-w4-only-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=6, groups=(Group(4),)), delay=1, failures=True),
    "hybrid-k2-w5-full-delayed-failures-fail-policy": Scenario(  # a failed load ends its request
        Config(num_gpu_blocks=24, offload_block_size=4, tier_blocks=6, groups=(Group(5), Group()),
               prefix_caching=False, load_failure_policy="fail"), delay=2, failures=True),
    "hybrid-w4-full-immediate": Scenario(Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(4), Group()))),
    "hybrid-full-w6-w3-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=30, tier_blocks=8, groups=(Group(), Group(6), Group(3)), prefix_caching=False)),
    "hybrid-k2-w5-full-delayed-failures": Scenario(
        Config(num_gpu_blocks=24, offload_block_size=4, tier_blocks=6, groups=(Group(5), Group()),
               prefix_caching=False), delay=2, failures=True),
    "hybrid-w6-full-async-spec2-dense": Scenario(  # every window block kept in the prefix cache, not only the
        Config(num_gpu_blocks=28, tier_blocks=8, groups=(Group(6), Group()), async_scheduling=True,  # last ones
               num_spec_tokens=2, retention_interval=None), delay=1),
    "hybrid-full-w4-tp2-delayed-failures": Scenario(
        Config(num_gpu_blocks=24, tier_blocks=6, groups=(Group(), Group(4)), num_workers=2, prefix_caching=False),
        delay=1, failures=True),
    "hybrid-w8@4-full-delayed-failures": Scenario(
        Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(8, block_size=4), Group())), delay=1, failures=True),
    "hybrid-full@4-w3-k2-async-spec2-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=28, offload_block_size=4, tier_blocks=8, groups=(Group(block_size=4), Group(3)),
               async_scheduling=True, num_spec_tokens=2, prefix_caching=False), delay=1),
    "hybrid-full-full@4-k2-delayed": Scenario(
        Config(num_gpu_blocks=24, offload_block_size=4, tier_blocks=8, groups=(Group(), Group(block_size=4))),
        delay=2),
    "hybrid-w4-full-prompts-only-threshold2-delayed": Scenario(
        Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(4), Group()), store_threshold=2,
               store_prompts_only=True), delay=1),
    # recurrent state (Qwen3-Next, Nemotron-H, Jamba style), with attention and alone (a Mamba2 model); stores that
    # outlive the chunk after theirs (vLLM frees a state's block then)
    "hybrid-state-full-delayed-failures": Scenario(
        Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(state=True), Group())), delay=1, failures=True),
    "hybrid-full-state-w4-async-tp2-delayed-failures": Scenario(
        Config(num_gpu_blocks=28, tier_blocks=16, groups=(Group(), Group(state=True), Group(4)), async_scheduling=True,
               num_workers=2), delay=3, failures=True),
    "hybrid-state-only-every8-delayed": Scenario(  # the prefix cache keeps a state every 8 tokens too
        Config(num_gpu_blocks=16, tier_blocks=6, groups=(Group(state=True),), retention_interval=8), delay=2),
    # with speculative decoding: a block for the state after each draft, moved to the end of the table once a chunk
    # passes it (vLLM's ``_relocate_speculative_block``)
    "hybrid-state-full-spec2-delayed-failures": Scenario(
        Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8,
               groups=(Group(state=True), Group()), num_spec_tokens=2), delay=1, failures=True),
    "hybrid-state-w6-async-spec3-delayed": Scenario(
        Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8,
               groups=(Group(state=True), Group(6)), async_scheduling=True, num_spec_tokens=3), delay=2),
    # Mamba2 and KDA layers save a prefill checkpoint inside the prompt's last chunk, into a block kept for it (a
    # speculative block that would move stays there)
    "hybrid-state-full-checkpoints-async-spec3-delayed-failures": Scenario(
        Config(num_gpu_blocks=28, block_size=4, offload_block_size=4, tier_blocks=8, token_budget=16,
               groups=(Group(state=True), Group()), async_scheduling=True, num_spec_tokens=3, checkpoint_alignment=1),
        delay=2, failures=True),
    "hybrid-full@6-w5-full@4-tp2-no-prefix-cache": Scenario(
        Config(num_gpu_blocks=36, tier_blocks=24, groups=(Group(block_size=6), Group(5), Group(block_size=4)),
               num_workers=2, prefix_caching=False), delay=1, failures=True),
}

# Fleets: engines behind one router sharing one store (records, in the store's byte budget for the whole fleet),
# engines of another model on the same store, crashes and restarts, and the store's own faults (records that
# vanish, are torn or flipped; outages; restarts with or without its records; late answers). The tier is smaller than
# the store, so that hits come from the store.
FLEET_SCENARIOS = {
    "fleet2-k1-immediate": Scenario(
        Config(num_gpu_blocks=14, tier_blocks=6, prefix_caching=False), engines=2, store=24),
    "fleet3-k2-models-restarts-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, offload_block_size=4, tier_blocks=4, prefix_caching=False), delay=1,
        failures=True, engines=3, identities=(0, 0, 1), store=12, store_delay=2, restarts=True),
    "fleet2-tp2-async-spec2-delayed-failures": Scenario(
        Config(num_gpu_blocks=16, tier_blocks=6, num_workers=2, async_scheduling=True, num_spec_tokens=2),
        delay=1, failures=True, engines=2, store=16, store_delay=1, restarts=True),
    "fleet2-hybrid-w4-full-delayed": Scenario(
        Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(4), Group()), prefix_caching=False), delay=1,
        engines=2, store=24, store_delay=1),
    "fleet2-state-full-delayed": Scenario(  # a hybrid linear-attention model: states shared like KV, and restarts
        Config(num_gpu_blocks=24, tier_blocks=8, groups=(Group(state=True), Group())), delay=1, engines=2, store=24,
        store_delay=1, restarts=True),
    "fleet2-threshold2-delayed": Scenario(  # records a get fetches are taken whatever admission says
        Config(num_gpu_blocks=14, tier_blocks=8, prefix_caching=False, store_threshold=2), delay=1, engines=2,
        store=24),
    "fleet2-weight-versions": Scenario(  # engines update to the same or other weights, whatever their count, and
        # restart on a checkpoint a fine-tune may have replaced
        Config(num_gpu_blocks=14, tier_blocks=6, prefix_caching=False), delay=1, engines=2, store=24,
        weight_versions=True, restarts=True),
    "fleet2-sync-fail-policy-delayed-failures": Scenario(  # a record a lookup gets loads in the step that computes
        Config(num_gpu_blocks=14, tier_blocks=6, prefix_caching=False, load_failure_policy="fail", sync_loads=True),
        delay=1, failures=True, engines=2, store=24, store_delay=1),
    "fleet2-dead-store": Scenario(
        Config(num_gpu_blocks=14, tier_blocks=4, prefix_caching=False), delay=1, engines=2, store=8, store_dead=True),
}
