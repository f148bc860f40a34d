//! PPO job configuration and prompt datasets.
