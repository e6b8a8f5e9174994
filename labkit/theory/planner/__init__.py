"""The at-scale planner: hardware constants, the op-by-op time model, what a GPU holds at its
peak, the search over layouts and the published runs it is judged on (`theory.evaluate`,
`theory.plan`)."""
