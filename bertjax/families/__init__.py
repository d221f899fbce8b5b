"""The model families, one floor above training and interop: each family's adapter (`bert`,
`modernbert`) registers a `bertjax.models.families.Family` that says what shared code needs of
it (its config, models, loss, checkpoint forms and task heads)."""
