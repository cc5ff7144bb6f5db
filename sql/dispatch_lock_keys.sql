-- Finalize, step 0: lock the keys being finalized, in key order, before the
-- statements below touch them one after another. Ingest locks heads in key
-- order too; without this, finalize could hold one key (from the delete)
-- while waiting for another (the park or release) that ingest holds while
-- waiting for the first: a deadlock.
SELECT FROM deferred_key
WHERE business_key = ANY ($1::text[])
ORDER BY business_key
FOR NO KEY UPDATE
