-- This process ($1) stopped cleanly; stale rows of crashed ones are pruned by
-- instance_prune.sql.
DELETE FROM scheduler_instance WHERE id = $1
