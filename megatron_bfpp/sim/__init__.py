"""Cost model, event simulator and configuration planner over the same lowered schedules the runtime executes."""

from .costs import Config, Costs, analytic_costs, memory_breakdown, peak_activation_bytes, unit_costs
from .engine import EngineResult, simulate_schedule, step_lower_bound_s
from .hardware import PROFILES, Hardware, get_hardware
from .model import MODELS, ModelProfile, Partition, get_model
from .planner import STOCK, PlanResult, SearchSpace, plan, stock_schedule, stock_space
from .predict import Prediction, check_config, config_dict, predict

__all__ = [
    "Config", "Costs", "analytic_costs", "memory_breakdown", "peak_activation_bytes", "unit_costs",
    "EngineResult", "simulate_schedule", "step_lower_bound_s", "PROFILES", "Hardware", "get_hardware", "MODELS", "ModelProfile",
    "Partition", "get_model", "PlanResult", "SearchSpace", "STOCK", "plan", "stock_schedule", "stock_space",
    "Prediction", "check_config", "config_dict", "predict",
]
