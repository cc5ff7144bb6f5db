-- Finalize, step 2: lock the keys being finalized ($1), in key order (see
-- dispatch_lock_messages.sql for why).
SELECT FROM deferred_key
WHERE business_key = ANY ($1::text[])
ORDER BY business_key
FOR NO KEY UPDATE
