"""Built-in stages, one per module. Import from here or from ``kvpolicy``."""

from .accumulated_attention import AccumulatedAttentionScorer
from .adaptive import AdaptiveAllocation
from .arrival_score import ArrivalScoreScorer
from .attention import AttentionScorer
from .base import (
    Allocation,
    EvictionInput,
    Merge,
    MergeResult,
    Reservation,
    Scorer,
    Selector,
    Stage,
    StateField,
)
from .cake import CakeAllocation, CakeScorer
from .chunks import ChunkSelector
from .combination import CombinationScorer, WeightedTerm
from .current_attention import CurrentAttentionScorer
from .duo import DuoAllocation
from .expected_attention import ExpectedAttentionScorer
from .gkv import GKVScorer
from .greedy import GreedySelector
from .head_profile import ProfileAllocation
from .keep_protected import KeepProtectedSelector
from .key_norm import KeyNormScorer
from .lag import LagScorer
from .landmark import LandmarkScorer
from .layer_list import LayerListAllocation
from .leverage import LeverageScorer
from .merge_cam import CamMerge
from .merge_d2o import D2OMerge
from .merge_drop import DropMerge
from .merge_similar import SimilarMerge
from .model_facts import ModelFacts
from .normalized import NormalizedScorer
from .output_norm import OutputValueNormScorer
from .product import Factor, ProductScorer
from .prompt import PromptReservation
from .pyramid import PyramidAllocation
from .quest import QuestScorer
from .random_score import RandomScorer
from .redundancy import RedundancyScorer
from .shared_heads import SharedHeadsScorer
from .sinks import SinksReservation
from .smoothed_attention import SmoothedAttentionScorer
from .spec import AllocationSpec, MergeSpec, ReservationSpec, ScorerSpec, SelectorSpec
from .stochastic import StochasticSelector
from .threshold import ThresholdSelector
from .top_scores import TopScoresReservation
from .triattention import QueryCalibration, TriAttentionScorer
from .uniform import UniformAllocation
from .value_magnitude import ValueMagnitudeScorer

BUILTIN_STAGES = (
    AttentionScorer,
    AccumulatedAttentionScorer,
    SmoothedAttentionScorer,
    CurrentAttentionScorer,
    QuestScorer,
    LandmarkScorer,
    RedundancyScorer,
    LeverageScorer,
    ValueMagnitudeScorer,
    KeyNormScorer,
    LagScorer,
    RandomScorer,
    CombinationScorer,
    ExpectedAttentionScorer,
    OutputValueNormScorer,
    ProductScorer,
    TriAttentionScorer,
    GKVScorer,
    NormalizedScorer,
    SharedHeadsScorer,
    CakeScorer,
    ArrivalScoreScorer,
    SinksReservation,
    TopScoresReservation,
    PromptReservation,
    GreedySelector,
    StochasticSelector,
    KeepProtectedSelector,
    ChunkSelector,
    ThresholdSelector,
    UniformAllocation,
    PyramidAllocation,
    LayerListAllocation,
    AdaptiveAllocation,
    ProfileAllocation,
    DuoAllocation,
    CakeAllocation,
    DropMerge,
    SimilarMerge,
    CamMerge,
    D2OMerge,
)

__all__ = [
    "BUILTIN_STAGES",
    "CamMerge",
    "D2OMerge",
    "DropMerge",
    "Merge",
    "MergeResult",
    "MergeSpec",
    "SimilarMerge",
    "AccumulatedAttentionScorer",
    "AdaptiveAllocation",
    "ArrivalScoreScorer",
    "Allocation",
    "AllocationSpec",
    "ChunkSelector",
    "DuoAllocation",
    "LayerListAllocation",
    "ProfileAllocation",
    "PyramidAllocation",
    "UniformAllocation",
    "AttentionScorer",
    "CakeAllocation",
    "CakeScorer",
    "CombinationScorer",
    "CurrentAttentionScorer",
    "EvictionInput",
    "ExpectedAttentionScorer",
    "Factor",
    "GKVScorer",
    "GreedySelector",
    "KeepProtectedSelector",
    "KeyNormScorer",
    "LagScorer",
    "LandmarkScorer",
    "QuestScorer",
    "LeverageScorer",
    "ModelFacts",
    "OutputValueNormScorer",
    "ProductScorer",
    "PromptReservation",
    "QueryCalibration",
    "NormalizedScorer",
    "SharedHeadsScorer",
    "RandomScorer",
    "RedundancyScorer",
    "Reservation",
    "Scorer",
    "ReservationSpec",
    "ScorerSpec",
    "SelectorSpec",
    "Selector",
    "SinksReservation",
    "SmoothedAttentionScorer",
    "Stage",
    "StateField",
    "StochasticSelector",
    "ThresholdSelector",
    "TopScoresReservation",
    "TriAttentionScorer",
    "ValueMagnitudeScorer",
    "WeightedTerm",
]
